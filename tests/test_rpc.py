"""Request/reply with credits on real sockets."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from asyncrl.wire import framing
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.errors import ChannelClosed, PeerLost, RemoteError
from asyncrl.wire.messages import Command, CommandResult
from asyncrl.wire.rpc import RpcClient, RpcServer
from asyncrl.wire.sockets import free_tcp_endpoint

REQ, REP = Codec(Command), Codec(CommandResult)


async def echo(cmd: Command, peer: bytes) -> CommandResult:
    if cmd.kind == "stop":
        raise RuntimeError("refusing to stop")
    await asyncio.sleep(float(cmd.args.get("sleep", 0)))
    return CommandResult(ok=True, data={"peer": peer.decode(), **cmd.args})


async def test_calls_return_their_own_replies_even_out_of_order(endpoint: str):
    async with (
        RpcServer(endpoint, REQ, REP, echo) as server,
        RpcClient(server.endpoint, REQ, REP, identity="client-a") as client,
    ):
        slow = asyncio.create_task(client.call(Command(kind="ping", args={"sleep": 0.3, "i": 1})))
        fast = await client.call(Command(kind="ping", args={"i": 2}))
        assert fast.data == {"peer": "client-a", "i": 2}
        assert (await slow).data["i"] == 1


async def test_a_client_never_has_more_calls_in_flight_than_its_credits(endpoint: str):
    active, peak = 0, 0

    async def tracked(cmd: Command, peer: bytes) -> CommandResult:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return CommandResult(ok=True)

    async with (
        RpcServer(endpoint, REQ, REP, tracked) as server,
        RpcClient(server.endpoint, REQ, REP, max_inflight=3) as client,
    ):
        async with asyncio.TaskGroup() as tg:
            for _ in range(20):
                tg.create_task(client.call(Command(kind="ping")))
    assert peak == 3


async def test_a_raising_handler_is_a_remote_error_and_the_server_keeps_serving(endpoint: str):
    async with (
        RpcServer(endpoint, REQ, REP, echo) as server,
        RpcClient(server.endpoint, REQ, REP) as client,
    ):
        with pytest.raises(RemoteError, match="RuntimeError: refusing to stop"):
            await client.call(Command(kind="stop"))
        assert (await client.call(Command(kind="ping"))).ok


async def test_malformed_requests_are_answered_with_an_error_and_counted(endpoint: str):
    async with RpcServer(endpoint, REQ, REP, echo) as server:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        bad = framing.Request(v=WIRE_VERSION, id=5, nbuf=0, body=framing.NIL)
        await sock.send_multipart([framing.pack(bad)])
        await sock.send_multipart([b"\x00\x01 not an envelope"])
        async with asyncio.timeout(5):
            reply = framing.unpack((await sock.recv_multipart())[0], framing.Reply)
        assert reply.id == 5 and reply.error.startswith("bad request:")
        # The second message gets no reply: wait until the server has read it too.
        async with asyncio.timeout(5):
            while server.stats.dropped.get("malformed", 0) < 2:  # noqa: ASYNC110 - a counter
                await asyncio.sleep(0.01)
        assert server.stats.dropped["malformed"] == 2
        sock.close()


async def test_pending_calls_fail_with_peer_lost_when_the_server_goes_away():
    ep = free_tcp_endpoint()
    async with RpcClient(ep, REQ, REP) as client:
        async with RpcServer(ep, REQ, REP, echo):
            await client.call(Command(kind="ping"))  # connected
            pending = asyncio.create_task(client.call(Command(kind="ping", args={"sleep": 30})))
            await asyncio.sleep(0.1)
        with pytest.raises(PeerLost, match="may or may not have run"):
            async with asyncio.timeout(10):
                await pending


async def test_a_reply_after_the_caller_gave_up_is_dropped_and_counted(endpoint: str):
    async with (
        RpcServer(endpoint, REQ, REP, echo) as server,
        RpcClient(server.endpoint, REQ, REP) as client,
    ):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await client.call(Command(kind="ping", args={"sleep": 0.2}))
        await asyncio.sleep(0.4)
        assert client.stats.dropped["late_reply"] == 1
        assert client.in_flight == 0


async def test_an_error_raised_inside_the_channel_block_reaches_the_caller_unwrapped(endpoint: str):
    with pytest.raises(RemoteError):  # not an ExceptionGroup
        async with (
            RpcServer(endpoint, REQ, REP, echo) as server,
            RpcClient(server.endpoint, REQ, REP) as client,
        ):
            await client.call(Command(kind="stop"))


async def test_calls_after_close_raise_channel_closed(endpoint: str):
    async with RpcServer(endpoint, REQ, REP, echo) as server:
        client = RpcClient(server.endpoint, REQ, REP)
        async with client:
            pass
        with pytest.raises(ChannelClosed):
            await client.call(Command(kind="ping"))


async def test_an_oversized_request_gets_an_error_reply_not_silence(endpoint: str):
    small = Codec(Command, max_frame_bytes=1024)
    async with (
        RpcServer(endpoint, small, REP, echo) as server,
        RpcClient(server.endpoint, REQ, REP) as client,
    ):
        with pytest.raises(RemoteError, match="larger than the limit of 1024 bytes"):
            async with asyncio.timeout(5):
                await client.call(Command(kind="ping", args={"x": "y" * 200_000}))
        assert (await client.call(Command(kind="ping"))).ok
