"""The one wire: ZeroMQ channels carrying MessagePack records (``docs/design.md`` section 3).

| module        | holds                                                              |
|---------------|--------------------------------------------------------------------|
| ``codec``     | ``Message`` base and ``Codec``: records + out-of-band arrays       |
| ``messages``  | control-plane records (``Heartbeat``, ``Command``, ``WeightVersion``) |
| ``channels``  | ``SendChannel`` / ``ReceiveChannel`` contracts, ``ChannelStats``    |
| ``reliable``  | at-least-once results channel (acks, redelivery, de-duplication)   |
| ``rpc``       | request/reply with credits (work and batch requests)               |
| ``pubsub``    | latest-wins broadcast with seqs, gap detection and snapshots       |
| ``blob``      | chunked pull of large tensor sets (weights)                        |
| ``control``   | controller <-> actor heartbeats and commands                       |
| ``framing``   | channel envelopes around encoded messages                          |
| ``sockets``   | socket options, loopback-by-default binding                        |
| ``security``  | CurveZMQ on every socket: the job certificate, its ZAP handler     |
| ``ranges``    | ``RangeSet``: seq bookkeeping of the reliable channel              |
| ``errors``    | ``WireError``, ``ChannelClosed``, ``PeerLost``, ...                 |
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
