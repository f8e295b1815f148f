"""Small actors for lifecycle and supervision tests (imported by child processes too)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from asyncrl.actors.base import Actor
from asyncrl.actors.config import ActorConfig
from asyncrl.wire.messages import Command, Scalar


class RecorderConfig(ActorConfig):
    """The test actors' knobs, each one's default its idle behaviour."""

    journal: str | None = None  # each lifecycle step is appended here
    version: int = 0
    linger: float = 0.0  # seconds run() waits before it idles
    drain_seconds: float = 0.0
    after: float = 0.2  # Crasher: seconds before it raises
    grandchild: str | None = None  # Spawner: where it writes its child's pid
    daemon: bool = False  # Spawner: the child gets a session of its own (no stop reaches it)
    prepare_s: float = 0.0  # seconds a supervisor test's before_restart takes
    block_setup: float = 0.0  # SlowSetup: seconds its set-up holds the event loop


class Recorder(Actor):
    """Idles until stopped; appends each lifecycle step to ``config.journal``."""

    Config = RecorderConfig
    config: RecorderConfig

    def note(self, step: str) -> None:
        if self.config.journal:
            with Path(self.config.journal).open("a") as f:
                f.write(step + "\n")

    async def setup(self) -> None:
        self.ticks = 0
        self.note("setup")

    async def run(self) -> None:
        self.note("run")
        self.version = self.config.version
        while not self.stopping:
            self.ticks += 1
            await asyncio.sleep(0.01)
        await asyncio.sleep(self.config.linger)

    async def drain(self) -> None:
        self.note("drain")
        await asyncio.sleep(self.config.drain_seconds)
        self.note("drained")

    async def teardown(self) -> None:
        self.note("teardown")

    def stats(self) -> dict[str, float]:
        return {"ticks": float(self.ticks)}

    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        self.note(f"command:{cmd.kind}")
        return await super().on_command(cmd)


class Crasher(Recorder):
    """Raises from ``run()`` after a few ticks."""

    async def run(self) -> None:
        print("crasher: about to fail", flush=True)
        await asyncio.sleep(self.config.after)
        raise RuntimeError("boom at step 3")


class BadInput(Recorder):
    """Fails while setting up, as an actor given a malformed file does."""

    async def setup(self) -> None:
        from asyncrl.buffer.sources import DataError

        await super().setup()
        raise DataError("data.jsonl:3: invalid JSON")


class HardExit(Recorder):
    """Leaves with ``os._exit(3)``: no Bye, no cleanup, like a segfaulting extension."""

    async def run(self) -> None:
        print("hard-exit: last words", flush=True)
        sys.stdout.flush()
        await asyncio.sleep(0.3)
        os._exit(3)


class Hanger(Recorder):
    """Blocks its event loop: no heartbeat leaves any more."""

    async def run(self) -> None:
        await asyncio.sleep(0.5)
        print("hanger: blocking the loop", flush=True)
        time.sleep(3600)  # noqa: ASYNC251 - the point: a blocked event loop


class NotAnActor:
    """Named in a spec by mistake."""


class Chatty(Recorder):
    """Prints one 2 MiB line, then idles: overlong output must not stop the runtime."""

    async def run(self) -> None:
        print("x" * (2 << 20), flush=True)
        print("chatty: after the long line", flush=True)
        await super().run()


class Spawner(Recorder):
    """Starts a grandchild that inherits stdout (and so the runtime's pipe), then idles."""

    async def run(self) -> None:
        import subprocess

        # A daemon is started as torch's shm manager is: a fork and exec that keeps every
        # inheritable descriptor.
        self.child = subprocess.Popen(  # noqa: ASYNC220 - test fixture
            ["sleep", "60"], start_new_session=self.config.daemon, close_fds=not self.config.daemon
        )
        Path(str(self.config.grandchild)).write_text(str(self.child.pid))  # noqa: ASYNC240
        await super().run()


class BusySetup(Recorder):
    """Tokenises a huge file, say: its set-up blocks a worker thread for a minute."""

    async def setup(self) -> None:
        self.note("setup")
        await asyncio.to_thread(time.sleep, 60)


class SlowSetup(Recorder):
    """Holds its event loop in set-up for ``block_setup`` seconds, as heavy imports and a
    model load do on a loaded machine."""

    async def setup(self) -> None:
        time.sleep(self.config.block_setup)  # noqa: ASYNC251 - the point: a blocked loop
        await super().setup()


class Reporter(Recorder):
    """Writes what its process inherited (environment, directory, session, parent, a numpy
    draw) to ``<journal>.json`` at set-up, then idles."""

    async def setup(self) -> None:
        import json

        import numpy as np

        facts = {
            "mark": os.environ.get("ASYNCRL_TEST_MARK"),
            "cwd": os.getcwd(),
            "leads_session": os.getsid(0) == os.getpid(),
            "parent": os.getppid(),
            "draw": float(np.random.random()),
        }
        facts["path0"] = sys.path[0]
        report = Path(f"{self.config.journal}.json")
        report.with_suffix(".tmp").write_text(json.dumps(facts))
        report.with_suffix(".tmp").replace(report)  # whole, or not there
        await super().setup()
