"""The fork server: local actors fork from one process that imported torch once; it
outlives a job, keeps environments apart, and takes its actors with it when it dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from asyncrl.runtime import forks, local
from asyncrl.runtime.local import LocalActor, LocalRuntime
from tests.test_runtime import spec

ROOT = Path(__file__).resolve().parents[1]


async def facts(runtime: LocalRuntime, name: str, tmp_path: Path) -> tuple[LocalActor, dict]:
    """Start a ``Reporter`` and read what it found in its process."""
    handle = await runtime.start(spec(name, "Reporter", tmp_path))
    report = tmp_path / f"{name}.journal.json"
    async with asyncio.timeout(120):
        while not report.exists():
            assert handle.exit_code is None, handle.tail()
            await asyncio.sleep(0.05)
    return handle, json.loads(report.read_text())


async def test_actors_fork_from_one_zygote_that_outlives_the_job(tmp_path):
    parents = []
    for job in ("first", "second"):
        run = tmp_path / job
        async with LocalRuntime(run, env={"ASYNCRL_TEST_MARK": "m"}) as runtime:
            _, a = await facts(runtime, "a", run)
            _, b = await facts(runtime, "b", run)
            for handle in runtime.actors:
                assert await runtime.stop(handle, grace=10) == 0
        assert a["parent"] == b["parent"] != os.getpid()
        assert a["mark"] == "m" and a["cwd"] == os.getcwd() and a["leads_session"]
        assert a["draw"] != b["draw"], "forks share numpy's global stream"
        parents.append(a["parent"])
    assert parents[0] == parents[1], "the second job started a zygote of its own"


async def test_a_job_with_another_environment_gets_a_zygote_of_its_own(tmp_path):
    async with LocalRuntime(tmp_path / "plain") as runtime:
        plain, one = await facts(runtime, "a", tmp_path / "plain")
        # A zygote with a child running is kept while another environment is served.
        async with LocalRuntime(tmp_path / "other", env={"ASYNCRL_TEST_MARK": "x"}) as other:
            _, two = await facts(other, "b", tmp_path / "other")
        assert plain.exit_code is None
    assert one["parent"] != two["parent"] and two["mark"] == "x" and one["mark"] is None


async def test_a_stop_sent_to_every_process_leaves_the_zygote_to_the_controller(tmp_path):
    async with LocalRuntime(tmp_path) as runtime:
        handle, found = await facts(runtime, "a", tmp_path)
        os.killpg(found["parent"], signal.SIGTERM)  # its group: it leads one
        os.killpg(found["parent"], signal.SIGINT)
        await asyncio.sleep(0.5)
        assert handle.exit_code is None
        os.kill(found["parent"], 0)  # the zygote lives
        assert await runtime.stop(handle, grace=10) == 0


async def test_a_killed_zygote_takes_its_actors_and_the_next_job_gets_another(tmp_path):
    async with LocalRuntime(tmp_path / "one") as runtime:
        handle, found = await facts(runtime, "a", tmp_path / "one")
        assert found["parent"] != os.getpid()  # never SIGKILL ourselves
        os.kill(found["parent"], signal.SIGKILL)
        async with asyncio.timeout(30):
            assert await handle.wait() == -signal.SIGKILL
        assert not forks._running(handle.pid), "the dead zygote's actor still runs"
    async with LocalRuntime(tmp_path / "two") as runtime:
        handle, again = await facts(runtime, "a", tmp_path / "two")
        assert again["parent"] != found["parent"]
        assert await runtime.stop(handle, grace=10) == 0


@pytest.mark.parametrize("how", ["unavailable", "off"])
async def test_without_a_zygote_actors_are_started_with_exec(tmp_path, monkeypatch, how):
    async def refuse(*args, **kwargs):
        if how == "off":
            pytest.fail("a runtime told not to fork asked the zygote")
        raise forks.ZygoteUnavailable("refused for the test")

    monkeypatch.setattr(local, "fork_actor", refuse)
    async with LocalRuntime(tmp_path, fork_server=how == "unavailable") as runtime:
        handle, found = await facts(runtime, "a", tmp_path)
        assert found["parent"] == os.getpid() and found["leads_session"]
        assert await runtime.stop(handle, grace=10) == 0
    assert not runtime.fork_server


async def test_idle_zygotes_can_be_closed_and_the_next_job_starts_another(tmp_path):
    async with LocalRuntime(tmp_path / "one", env={"ASYNCRL_TEST_MARK": "idle"}) as runtime:
        handle, first = await facts(runtime, "a", tmp_path / "one")
        assert first["parent"] in forks.zygote_pids()
        forks.close_idle_zygotes()  # busy: kept
        assert first["parent"] in forks.zygote_pids()
        assert await runtime.stop(handle, grace=10) == 0
    forks.close_idle_zygotes()
    assert first["parent"] not in forks.zygote_pids()
    async with LocalRuntime(tmp_path / "two", env={"ASYNCRL_TEST_MARK": "idle"}) as runtime:
        handle, again = await facts(runtime, "a", tmp_path / "two")
        assert again["parent"] != first["parent"]
        assert await runtime.stop(handle, grace=10) == 0


async def test_a_fork_in_another_directory_finds_modules_there_as_an_exec_would(
    tmp_path, monkeypatch
):
    """``python -m`` puts the start directory first on the path: a fork from a zygote
    started elsewhere gets the job's directory there instead."""
    root = str(ROOT)
    env = {"PYTHONPATH": root, "ASYNCRL_TEST_MARK": "path"}
    async with LocalRuntime(tmp_path / "one", env=env) as runtime:
        _, first = await facts(runtime, "a", tmp_path / "one")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        _, second = await facts(runtime, "b", tmp_path / "one")
    assert first["parent"] == second["parent"]
    assert first["path0"] == root and second["path0"] == str(elsewhere)
    assert second["cwd"] == str(elsewhere)


async def test_a_prestarted_zygote_is_the_one_the_jobs_runtime_forks_from(tmp_path):
    """``asyncrl train`` starts the zygote before its checks; the job's runtime (the same
    environment) must take that one up, not start another."""
    from asyncrl.api import prestart
    from asyncrl.config import load_config

    forks.close_idle_zygotes()
    await asyncio.to_thread(prestart, load_config(overrides=["--seed", "1"]))
    (started,) = forks.zygote_pids()
    async with LocalRuntime(tmp_path) as runtime:
        handle, found = await facts(runtime, "a", tmp_path)
        assert found["parent"] == started
        assert await runtime.stop(handle, grace=10) == 0


async def test_a_fork_whose_pipe_fails_to_connect_closes_its_descriptor_once(tmp_path, monkeypatch):
    """A connect that fails (a cancel) closes its transport, which closes the pipe on a
    later loop turn; the fork must not also close the bare number, which by then may
    name another descriptor (here the next pipe made)."""
    loop = asyncio.get_running_loop()
    connect = loop.connect_read_pipe

    async def cancelled(factory, pipe):
        transport, _ = await connect(factory, pipe)
        transport.close()  # as asyncio does when the wait for the connection is cancelled
        raise asyncio.CancelledError

    monkeypatch.setattr(loop, "connect_read_pipe", cancelled)
    zygote = await asyncio.to_thread(forks.acquire_zygote, dict(os.environ))
    try:
        with pytest.raises(asyncio.CancelledError):
            await forks.fork_actor(zygote, dict(os.environ), str(tmp_path), b"{}", {}, 1024)
        r, w = os.pipe()  # the lowest free numbers: the fork's closed output end's
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # the transport's close runs
            os.fstat(r)  # EBADF if the fork's pipe was closed twice
            os.fstat(w)
        finally:
            os.close(r)
            os.close(w)
    finally:
        forks.release_zygote(zygote)


async def test_a_fork_cancelled_while_its_pipe_connects_leaves_no_descriptor(tmp_path, monkeypatch):
    """Cancelled mid-connect, the fork lets the connect finish and closes its transport:
    every descriptor it made is closed, each once (a pipe made after it survives)."""
    loop = asyncio.get_running_loop()
    connect, connecting = loop.connect_read_pipe, asyncio.Event()

    async def slow(factory, pipe):
        connecting.set()
        await asyncio.sleep(0.2)
        return await connect(factory, pipe)

    async def cancelled_fork() -> set[str]:
        """The descriptors open after a fork cancelled mid-connect has settled."""
        connecting.clear()
        fork = asyncio.create_task(
            forks.fork_actor(zygote, dict(os.environ), str(tmp_path), b"{}", {}, 1024)
        )
        await connecting.wait()
        fork.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fork
        r, w = os.pipe()
        try:
            await asyncio.sleep(0.5)  # the connect ends; its transport is closed
            os.fstat(r)  # EBADF had the pipe's number been closed twice
            os.fstat(w)
        finally:
            os.close(r)
            os.close(w)
        return set(os.listdir("/proc/self/fd"))

    monkeypatch.setattr(loop, "connect_read_pipe", slow)
    zygote = await asyncio.to_thread(forks.acquire_zygote, dict(os.environ))
    try:
        first = await cancelled_fork()  # and whatever is opened once, for good
        assert await cancelled_fork() == first
    finally:
        forks.release_zygote(zygote)
