"""The control channel: notifications up, commands down, unknown actors refused."""

from __future__ import annotations

import asyncio
import sys

import pytest

from asyncrl.wire.control import ControlLink, ControlServer
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.messages import Command, CommandResult, Heartbeat, Hello


async def test_notifications_reach_the_hub_tagged_with_the_actor_name(endpoint: str):
    async with ControlServer(endpoint) as hub, ControlLink(hub.endpoint, "rollout-3") as link:
        link.notify(Hello(actor="rollout-3", role="rollout", pid=11, host="h"))
        link.notify(Heartbeat(actor="rollout-3", pid=11, seq=0, state="running", version=2))
        async with asyncio.timeout(5):
            first, second = await hub.receive(), await hub.receive()
        assert first[0] == second[0] == "rollout-3"
        assert isinstance(first[1], Hello) and second[1].version == 2


async def test_commands_are_answered_by_the_named_actor(endpoint: str):
    async with ControlServer(endpoint) as hub, ControlLink(hub.endpoint, "trainer") as link:
        link.notify(Hello(actor="trainer", role="trainer", pid=1, host="h"))
        await hub.receive()

        async def serve() -> None:
            cid, cmd = await link.next_command()
            ok = cmd.kind != "stop"
            link.reply(
                cid, CommandResult(ok=ok, error=None if ok else "busy", data={"kind": cmd.kind})
            )

        async with asyncio.timeout(5):
            task = asyncio.create_task(serve())
            result = await hub.command("trainer", Command(kind="ping"))
            await task
            assert result.data == {"kind": "ping"}
            task = asyncio.create_task(serve())
            with pytest.raises(RemoteError, match="trainer: busy"):
                await hub.command("trainer", Command(kind="stop"))
            await task


async def test_a_command_to_an_unknown_actor_fails_at_once(endpoint: str):
    async with ControlServer(endpoint) as hub:
        with pytest.raises(PeerLost, match="'ghost' is not connected"):
            await hub.command("ghost", Command(kind="ping"))


async def test_a_reply_from_another_actor_cannot_answer_a_command(endpoint: str):
    async with (
        ControlServer(endpoint) as hub,
        ControlLink(hub.endpoint, "a") as a,
        ControlLink(hub.endpoint, "b") as b,
    ):
        for link in (a, b):
            link.notify(Hello(actor=link.actor, role="r", pid=1, host="h"))
            await hub.receive()
        task = asyncio.create_task(hub.command("a", Command(kind="ping")))
        cid, _ = await a.next_command()
        b.reply(cid, CommandResult(ok=True, data={"from": "b"}))  # forged
        await asyncio.sleep(0.2)
        assert not task.done() and hub.stats.dropped["malformed"] == 1
        a.reply(cid, CommandResult(ok=True, data={"from": "a"}))
        async with asyncio.timeout(5):
            assert (await task).data == {"from": "a"}


async def test_a_command_to_an_incarnation_that_is_gone_fails_instead_of_waiting(endpoint: str):
    """A command the old incarnation took and never answered fails with ``PeerLost`` once
    a new one says Hello (or the supervisor sees the old one exit), so a caller retries
    at once instead of waiting out its whole timeout (a restarted engine's rollout actor
    restarting too kept the engine 'restarting' for the whole wait)."""
    async with ControlServer(endpoint) as hub:
        async with ControlLink(hub.endpoint, "rollout-1") as old:
            old.notify(Hello(actor="rollout-1", role="rollout", pid=1, host="h"))
            await hub.receive()
            lost = asyncio.create_task(hub.command("rollout-1", Command(kind="engine_restarted")))
            await old.next_command()  # taken, never answered: the process dies
        async with ControlLink(hub.endpoint, "rollout-1") as new:
            new.notify(Hello(actor="rollout-1", role="rollout", pid=2, host="h"))
            async with asyncio.timeout(5):
                with pytest.raises(PeerLost, match="started again before it answered"):
                    await lost
                await hub.receive()
                again = asyncio.create_task(hub.command("rollout-1", Command(kind="ping")))
                cid, _ = await new.next_command()
                new.reply(cid, CommandResult(ok=True, data={"pid": 2}))
                assert (await again).data == {"pid": 2}
                waiting = asyncio.create_task(hub.command("rollout-1", Command(kind="ping")))
                await new.next_command()  # taken; then the supervisor sees the exit
                hub.abandon("rollout-1", "exited (-9) before it answered")
                with pytest.raises(PeerLost, match="exited"):
                    await waiting


_BYE_AND_EXIT = """
import asyncio, os, sys
from asyncrl.actors.base import _send_bye
from asyncrl.wire.control import ControlLink
from asyncrl.wire.messages import Bye

async def main(endpoint: str, actor: str) -> None:
    async with ControlLink(endpoint, actor) as link:
        link.notify(Bye(actor=actor, pid=os.getpid(), reason="stopped", ok=True))

endpoint, actor = sys.argv[1], sys.argv[2]
if actor.startswith("fallback"):
    _send_bye(endpoint, actor, Bye(actor=actor, pid=os.getpid(), reason="stopped", ok=True))
else:
    asyncio.run(main(endpoint, actor))
os._exit(0)  # at once, as an actor forked from a zygote ends
"""


async def test_the_bye_of_a_process_that_exits_at_once_reaches_the_controller(endpoint: str):
    """Closing the link waits for the Bye to leave: without it, a process that exits
    right after (a zygote's fork ends with ``os._exit``) lost it every time, and the
    supervisor took the finished actor's clean exit for a death and restarted it."""
    async with ControlServer(endpoint) as hub:
        actors = [f"{kind}-{i}" for kind in ("link", "fallback") for i in range(3)]
        for actor in actors:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _BYE_AND_EXIT, hub.endpoint, actor
            )
            assert await proc.wait() == 0
        got = []
        async with asyncio.timeout(10):
            while len(got) < len(actors):
                got.append(await hub.receive())
        assert [(name, type(msg).__name__) for name, msg in got] == [(a, "Bye") for a in actors]
