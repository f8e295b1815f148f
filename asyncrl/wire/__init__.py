"""The one wire: ZeroMQ channels carrying MessagePack records, nothing pickled.

``docs/design.md`` section 3 lists the channels, and its module map what each module holds.
"""

from asyncrl.wire.blob import BlobClient, BlobManifest, BlobServer
from asyncrl.wire.channels import ChannelStats, ReceiveChannel, SendChannel
from asyncrl.wire.codec import WIRE_VERSION, Codec, Message
from asyncrl.wire.control import ControlLink, ControlServer
from asyncrl.wire.errors import (
    ChannelClosed,
    EndOfStream,
    FrameTooLarge,
    PeerLost,
    RemoteError,
    WireError,
    WouldBlock,
)
from asyncrl.wire.pubsub import Publisher, Subscriber, Update
from asyncrl.wire.reliable import Delivery, Received, ReliableReceiver, ReliableSender
from asyncrl.wire.rpc import RpcClient, RpcServer

__all__ = [
    "WIRE_VERSION",
    "BlobClient",
    "BlobManifest",
    "BlobServer",
    "ChannelClosed",
    "ChannelStats",
    "Codec",
    "ControlLink",
    "ControlServer",
    "Delivery",
    "EndOfStream",
    "FrameTooLarge",
    "Message",
    "PeerLost",
    "Publisher",
    "ReceiveChannel",
    "Received",
    "ReliableReceiver",
    "ReliableSender",
    "RemoteError",
    "RpcClient",
    "RpcServer",
    "SendChannel",
    "Subscriber",
    "Update",
    "WireError",
    "WouldBlock",
]
