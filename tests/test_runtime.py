"""Local runtime + supervisor with real child processes: start, watch, report deaths, stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from asyncrl.actors.base import ActorSpec
from asyncrl.runtime.local import LocalRuntime
from asyncrl.runtime.run_dir import claim_run_dir
from asyncrl.runtime.supervisor import ActorDied, ActorHung, ActorStatus, Supervisor
from asyncrl.runtime.topology import allocate_endpoints
from asyncrl.wire import sockets
from asyncrl.wire.control import ControlServer


def spec(name: str, cls: str, tmp_path: Path, **params: object) -> ActorSpec:
    return ActorSpec(
        name=name,
        role="test",
        cls=f"tests.actors:{cls}",
        heartbeat_interval=0.2,
        drain_timeout=2.0,
        log_file=str(tmp_path / f"{name}.jsonl"),
        params={"journal": str(tmp_path / f"{name}.journal"), **params},
    )


async def death(supervisor: Supervisor) -> ActorDied:
    """Wait for the supervisor to report an actor lost, and return the report."""
    with pytest.raises(ActorDied) as info:
        async with asyncio.timeout(30):
            await supervisor.wait_until(lambda st: False)
    return info.value


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[Supervisor]:
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp_path) as runtime:
        async with Supervisor(runtime, hub, heartbeat_timeout=2.0, startup_timeout=60) as sup:
            yield sup
            await sup.stop_all(grace=5)


async def test_actors_start_send_heartbeats_and_stop_cleanly(
    supervisor: Supervisor, tmp_path: Path
):
    specs = [spec(f"a{i}", "Recorder", tmp_path) for i in range(2)]
    specs[0] = spec("a0", "Recorder", tmp_path, version=3)
    async with asyncio.timeout(60):
        await supervisor.launch(specs)
        await supervisor.wait_until(lambda st: all(s.heartbeats >= 2 for s in st.values()))
    a0 = supervisor.status["a0"]
    assert a0.state == "running" and a0.version == 3 and a0.stats["ticks"] > 0
    assert "control.sent" in a0.stats
    codes = await supervisor.stop_all(grace=10)
    assert codes == {"a0": 0, "a1": 0}
    assert supervisor.status["a0"].bye.ok and supervisor.status["a0"].bye.reason == "stopped"
    steps = (tmp_path / "a0.journal").read_text().split()
    assert steps == ["setup", "run", "command:stop", "drain", "drained", "teardown"]
    assert supervisor.failure is None
    assert (tmp_path / "logs" / "a0.out").stat().st_size > 0


async def test_sigterm_drains_and_exits_zero(supervisor: Supervisor, tmp_path: Path):
    await supervisor.launch([spec("t", "Recorder", tmp_path)])
    handle = supervisor.handles["t"]
    code = await supervisor.runtime.stop(handle, grace=10)
    assert code == 0
    assert (tmp_path / "t.journal").read_text().split()[-3:] == ["drain", "drained", "teardown"]


async def test_a_sigterm_the_runtime_did_not_send_is_a_fault_not_a_finish(
    supervisor: Supervisor, tmp_path: Path
):
    """A user's kill, an OOM killer's warning: the actor drains, then says it was stopped
    short, so that it is restarted or the job fails, never counted done."""
    await supervisor.launch([spec("t", "Recorder", tmp_path)])
    os.kill(supervisor.handles["t"].pid, signal.SIGTERM)
    died = await death(supervisor)
    assert died.exit_code == 1, died
    assert died.reason == "stopped by SIGTERM, which the controller did not send"
    assert (tmp_path / "t.journal").read_text().split()[-3:] == ["drain", "drained", "teardown"]


async def test_a_crash_is_reported_with_exit_code_reason_and_last_lines(
    supervisor: Supervisor, tmp_path: Path
):
    await supervisor.launch([spec("c", "Crasher", tmp_path, after=0.3)])
    died = await death(supervisor)
    assert died.name == "c" and died.exit_code == 1
    assert "RuntimeError: boom at step 3" in died.reason
    assert any("crasher: about to fail" in line for line in died.tail)
    assert "last log lines" in str(died)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
async def test_an_output_log_the_disk_refuses_leaves_the_runtime_and_the_tail_working(
    supervisor: Supervisor, tmp_path: Path
):
    """Every write to ``c.out`` fails as on a full disk (ENOSPC): the actor's output is
    still read to its end (a full pipe would block the child) and its death reported."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "c.out").symlink_to("/dev/full")
    await supervisor.launch([spec("c", "Crasher", tmp_path, after=0.3)])
    died = await death(supervisor)
    assert died.name == "c" and "RuntimeError: boom at step 3" in died.reason
    assert any("crasher: about to fail" in line for line in died.tail)
    assert "No space left on device" in supervisor.handles["c"].log_error


async def test_an_exit_without_goodbye_is_reported_with_its_code(
    supervisor: Supervisor, tmp_path: Path
):
    await supervisor.launch([spec("x", "HardExit", tmp_path)])
    died = await death(supervisor)
    assert died.exit_code == 3 and died.reason == "exited without saying why"
    assert any("hard-exit: last words" in line for line in died.tail)


async def test_an_actor_that_stops_heartbeating_is_declared_hung_and_killed(
    supervisor: Supervisor, tmp_path: Path
):
    await supervisor.launch([spec("h", "Hanger", tmp_path)])
    hung = await death(supervisor)
    assert isinstance(hung, ActorHung) and "no heartbeat for" in hung.reason
    async with asyncio.timeout(10):
        assert await supervisor.handles["h"].wait() == -9


async def test_a_set_up_that_holds_the_loop_past_the_heartbeat_timeout_is_not_hung(
    supervisor: Supervisor, tmp_path: Path
):
    # Heavy imports and a model load hold the loop for long on a loaded machine (CI's two
    # cores started seven actors): the heartbeat timeout (2 s) starts once set-up is done.
    await supervisor.launch([spec("s", "SlowSetup", tmp_path, block_setup=4.0)])
    async with asyncio.timeout(30):
        await supervisor.wait_until(lambda st: st["s"].state == "running")
    assert supervisor.status["s"].hung == "" and supervisor.deaths == []


async def test_a_set_up_that_never_ends_is_hung_after_the_startup_timeout(tmp_path: Path):
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp_path) as runtime:
        async with Supervisor(runtime, hub, heartbeat_timeout=1.0, startup_timeout=5) as sup:
            await sup.launch([spec("s", "SlowSetup", tmp_path, block_setup=3600)])
            hung = await death(sup)
    assert isinstance(hung, ActorHung), hung
    assert "while setting up" in hung.reason and float(hung.reason.split()[3][:-1]) >= 5


async def test_a_spec_naming_a_non_actor_fails_at_start_with_a_clear_message(
    supervisor: Supervisor, tmp_path: Path
):
    with pytest.raises(ActorDied) as info:
        await supervisor.launch([spec("bad", "NotAnActor", tmp_path)])
    assert info.value.exit_code == 2
    assert any("is not an asyncrl Actor subclass" in line for line in info.value.tail)


async def test_an_overlong_output_line_is_dropped_without_stopping_the_runtime(
    supervisor: Supervisor, tmp_path: Path
):
    await supervisor.launch([spec("chatty", "Chatty", tmp_path)])
    async with asyncio.timeout(20):
        await supervisor.wait_until(lambda st: st["chatty"].heartbeats >= 2)
    tail = supervisor.handles["chatty"].tail()
    assert any("output line over" in line for line in tail)
    assert any("chatty: after the long line" in line for line in tail)


async def test_stopping_an_actor_also_stops_what_it_started(supervisor: Supervisor, tmp_path: Path):
    pid_file = tmp_path / "grandchild.pid"
    await supervisor.launch([spec("s", "Spawner", tmp_path, grandchild=str(pid_file))])
    async with asyncio.timeout(20):
        await supervisor.wait_until(lambda st: pid_file.exists() and st["s"].heartbeats >= 1)
        codes = await supervisor.stop_all(grace=5)  # returns though the pipe may stay open
    assert codes == {"s": 0}
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {grandchild} outlived its actor")


async def _stop_a_daemon_spawner(run_dir: Path, pid_file: Path) -> dict[str, int]:
    """Launch a Spawner whose grandchild is a daemon (``pid_file``), then stop it; its
    exit codes. On the loop the caller runs (``asyncio.run``: asyncio's own)."""
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(run_dir) as runtime:
        async with Supervisor(runtime, hub, heartbeat_timeout=2.0, startup_timeout=60) as sup:
            launched = spec("s", "Spawner", run_dir, grandchild=str(pid_file), daemon=True)
            await sup.launch([launched])
            async with asyncio.timeout(20):
                await sup.wait_until(lambda st: pid_file.exists() and st["s"].heartbeats >= 1)
                return await sup.stop_all(grace=5)


def test_an_actor_is_seen_to_exit_while_a_daemon_it_started_holds_its_output(tmp_path: Path):
    """As torch's shm manager (the ipc transport's) outlives a trainer, in a session of
    its own that no stop reaches, holding the actor's stdout: the exit still counts. On
    asyncio's own loop, which the CLI's controller runs (its ``Process.wait`` waits for
    the pipes too; uvloop's, which the other tests run, does not)."""
    pid_file = tmp_path / "daemon.pid"
    try:
        assert asyncio.run(_stop_a_daemon_spawner(tmp_path, pid_file)) == {"s": 0}
        assert _alive(int(pid_file.read_text()))  # the pipe was still open
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_daemon_an_actor_started_does_not_keep_the_run_claimed(tmp_path: Path):
    """Actors inherit the run's lock (it stays claimed while any of them lives); what they
    execute does not, so torch's shm manager lingering after an ipc job does not refuse a
    --resume started right after it."""
    pid_file = tmp_path / "daemon.pid"
    try:
        with claim_run_dir(tmp_path):
            assert asyncio.run(_stop_a_daemon_spawner(tmp_path, pid_file)) == {"s": 0}
        assert _alive(int(pid_file.read_text()))
        with claim_run_dir(tmp_path, resume=True):  # at once: the daemon holds no lock
            pass
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_job_endpoints_are_distinct_and_below_the_ephemeral_port_range():
    """A port from below the kernel's ephemeral range cannot be taken by some outgoing
    connection between allocation and the actor's bind."""
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    endpoints = [ep for _ in range(20) for ep in allocate_endpoints().values()]
    sockets.release_endpoints(endpoints)  # 200 claims, each an open file: not kept for the session
    ports = [int(ep.rsplit(":", 1)[1]) for ep in endpoints]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < first for p in ports)


CLAIM_IN_A_CHILD = """
import sys, time
from asyncrl.wire import sockets
sockets._fixed_port_range = lambda: (int(sys.argv[1]), int(sys.argv[2]))
print(sockets.free_tcp_endpoint(), flush=True)
time.sleep(60)
"""


def bindable_pair() -> tuple[int, int]:
    """Two adjacent ports below the ephemeral range that nothing holds now: neither bound
    nor claimed, by another process or by this one (an earlier test's draw)."""
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for low in range(first - 2, 1024, -2):
        if all(free_and_unclaimed(port) for port in (low, low + 1)):
            return low, low + 2
    raise AssertionError("no two free ports below the ephemeral range")


def free_and_unclaimed(port: int) -> bool:
    if port in sockets._claims or not sockets._claim(port):
        return False
    sockets._release(port)
    return sockets._bindable("127.0.0.1", port)


def test_a_port_claimed_by_another_process_is_never_drawn_until_it_ends(monkeypatch):
    """Two jobs allocating at once: the port one drew stays its own until its actor binds
    it, even though nothing is bound to it in between (the race two jobs used to lose)."""
    low, high = bindable_pair()
    monkeypatch.setattr(sockets, "_fixed_port_range", lambda: (low, high))
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIM_IN_A_CHILD, str(low), str(high)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        theirs = child.stdout.readline().strip()
        assert theirs.startswith("tcp://127.0.0.1:"), theirs
        ours = [sockets.free_tcp_endpoint() for _ in range(3)]
        mine_in_range = [ep for ep in ours if low <= int(ep.rsplit(":", 1)[1]) < high]
        assert theirs not in ours and len(mine_in_range) == 1, (theirs, ours)
        sockets.release_endpoints(mine_in_range)
        assert sockets.free_tcp_endpoint() == mine_in_range[0]  # given back: drawn again
    finally:
        child.kill()
        child.wait()
    again = sockets.free_tcp_endpoint()
    sockets.release_endpoints([again, mine_in_range[0]])
    assert again == theirs  # its claim ended with the process


@pytest.fixture
async def restarting(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, list[str]]]:
    """A supervisor that restarts role ``test`` twice; yields it and the names it was asked
    to prepare a restart for (``before_restart``)."""
    prepared: list[str] = []

    async def before_restart(spec: ActorSpec, status: ActorStatus) -> None:
        prepared.append(spec.name)
        await asyncio.sleep(float(spec.params.get("prepare_s", 0)))

    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp_path) as runtime:
        async with Supervisor(
            runtime,
            hub,
            heartbeat_timeout=2.0,
            startup_timeout=60,
            restarts={"test": 2},
            before_restart=before_restart,
        ) as sup:
            yield sup, prepared
            await sup.stop_all(grace=5)


async def test_a_crashing_actor_is_restarted_until_its_budget_is_spent(
    restarting: tuple[Supervisor, list[str]], tmp_path: Path
):
    sup, prepared = restarting
    await sup.launch([spec("c", "Crasher", tmp_path, after=0.3)])
    died = await death(sup)
    # Two restarts survived (each prepared first), the third death ends the job.
    assert prepared == ["c", "c"] and sup.status["c"].restarts == 2
    assert [d.reason for d in sup.deaths] == ["RuntimeError: boom at step 3"] * 2
    assert "RuntimeError: boom at step 3" in died.reason
    setups = (tmp_path / "c.journal").read_text().split().count("setup")
    assert setups == 3  # three incarnations ran


async def test_an_actor_failing_on_its_input_while_setting_up_is_not_restarted(
    restarting: tuple[Supervisor, list[str]], tmp_path: Path
):
    sup, prepared = restarting
    await sup.launch([spec("b", "BadInput", tmp_path)])
    died = await death(sup)
    assert prepared == [] and sup.status["b"].restarts == 0 and sup.deaths == []
    assert "DataError: data.jsonl:3: invalid JSON" in died.reason
    assert "a restart would repeat: not restarted" in died.reason
    assert (tmp_path / "b.journal").read_text().split().count("setup") == 1


async def test_a_hung_actor_is_killed_and_restarted(
    restarting: tuple[Supervisor, list[str]], tmp_path: Path
):
    sup, _ = restarting
    await sup.launch([spec("h", "Hanger", tmp_path)])
    hung = await death(sup)
    assert isinstance(hung, ActorHung)
    assert len(sup.deaths) == 2 and all(isinstance(d, ActorHung) for d in sup.deaths)
    assert all("no heartbeat for" in d.reason for d in sup.deaths)


async def test_a_restart_under_way_when_the_job_stops_is_given_up(
    restarting: tuple[Supervisor, list[str]], tmp_path: Path
):
    sup, prepared = restarting
    # Preparing the restart takes a minute (a buffer that does not answer): the stop
    # must not wait for it, nor start a new incarnation after it.
    await sup.launch([spec("x", "HardExit", tmp_path, prepare_s=60)])
    async with asyncio.timeout(30):
        await sup._until(lambda: prepared == ["x"])
        codes = await sup.stop_all(grace=1)
    assert codes == {"x": 3}
    assert sup.failure is None and sup.status["x"].restarts == 1
    assert (tmp_path / "x.journal").read_text().split().count("setup") == 1


async def test_stopping_some_actors_leaves_the_others_restartable(
    restarting: tuple[Supervisor, list[str]], tmp_path: Path
):
    sup, prepared = restarting
    # The controller stops the producers before the final evaluation; an eval actor that
    # dies after that must still be restarted (it once waited out eval.final_timeout).
    await sup.launch([spec("producer", "Recorder", tmp_path), spec("eval", "Recorder", tmp_path)])
    await sup.stop(["producer"], grace=5)
    assert sup.handles["producer"].exit_code == 0
    killed = sup.handles["eval"].pid
    sup.runtime.kill(sup.handles["eval"])
    async with asyncio.timeout(30):
        await sup.wait_until(lambda st: st["eval"].pid != killed and st["eval"].hello)
    assert prepared == ["eval"] and sup.status["eval"].restarts == 1
    assert sup.failure is None and sup.status["producer"].restarts == 0


@pytest.mark.parametrize(
    ("checkpointed", "expected"),
    [(-1.0, False), (0.0, False), (2.0, True)],  # none; the base model only; a real one
)
async def test_a_restarted_trainer_must_find_a_checkpoint_only_once_one_was_complete(
    tmp_path, checkpointed, expected
):
    """The real-model chaos run found this: a trainer SIGKILLed while writing its first
    checkpoint (version 2, interval 2: seconds of writing on a 135M model) had reported
    version 2, so its restart was told to expect a checkpoint, found none and failed the
    job as lost state. What counts is the newest complete checkpoint it reported."""
    from asyncrl.actors.base import CHECKPOINTED_STAT
    from asyncrl.runtime.recovery import RestartHooks

    trainer = msgspec.structs.replace(spec("trainer", "Recorder", tmp_path), role="trainer")
    status = ActorStatus(name="trainer", role="trainer", version=2,
                         stats={CHECKPOINTED_STAT: checkpointed})  # fmt: skip
    hooks = RestartHooks(None, checkpoint_interval=2)  # type: ignore[arg-type]
    restarted = await hooks.before_restart(trainer, status)
    assert restarted is not None and restarted.incarnation.restarted
    assert restarted.incarnation.state_expected is expected
