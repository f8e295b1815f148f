"""Engine actors (``rollout.engine.serve: actor``): the server starts, is health-checked,
fails the actor with the reason when it dies or never comes up, and a training job
generates through it over HTTP with weights from disk.

The SGLang server itself needs a GPU; ``tests/sglang_stub`` puts a ``sglang.launch_server``
on the path that records its command line and serves asyncrl's own SGLang-compatible
engine, so the launcher (process group, health wait, output, stop) meets a real server.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.engine import EngineActor, sglang_command
from asyncrl.cli import _sglang_flags
from asyncrl.config import ConfigError, load_config
from asyncrl.engines.config import EngineConfig
from asyncrl.wire.sockets import free_tcp_endpoint
from tests.test_train import (
    LONG_RUN,
    accounted,
    job_flags,
    kill_mid_run,
    last_buffer_metrics,
    lines,
    write_prompts,
)
from tests.tiny_model import build_tiny_model

STUB = Path(__file__).parent / "sglang_stub"
SGLANG = ["--rollout.engine.type", "sglang", "--rollout.engine.serve", "actor"]
SGLANG += ["--update-weight-transport", "disk"]
DIST = ["--update-weight-transport", "dist"]
URLS = ["--rollout.engine.type", "sglang", "--rollout.engine.urls"]
VLLM_URLS = ["--rollout.engine.type", "vllm", "--rollout.engine.urls", "[http://x:1]"]
VLLM_URLS += ["--rollout.num-actors", "1"]
EVAL_SET = ["--eval-interval", "5", "--eval.sets", '[{name: a, path: "p.jsonl"}]']
VLLM = ["--rollout.engine.type", "vllm", "--rollout.engine.serve", "actor", *SGLANG[-2:]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine_actor") / "model"
    build_tiny_model(path)
    return path


def engine_actor(model: Path, api_key: str | None = None, **engine: object) -> EngineActor:
    spec = ActorSpec(
        name="engine-0",
        role="engine",
        cls="asyncrl.actors.engine:EngineActor",
        endpoints={"engine-0.http": free_tcp_endpoint()},
        drain_timeout=5.0,
        params={
            "engine": {"model_path": str(model), "serve": "actor", **engine},
            "api_key": api_key,
        },
    )
    return EngineActor(spec)


async def running(actor: EngineActor) -> asyncio.Task[int]:
    """Start ``actor``; its task once it runs (within 60 s)."""
    task = asyncio.create_task(actor.main())
    async with asyncio.timeout(60):
        while actor.state != "running":
            assert not task.done(), task.result()
            await asyncio.sleep(0.05)
    return task


def test_sglang_flags_become_the_servers_arguments():
    argv = ["train", "c.yaml", "--sglang-mem-fraction-static", "0.8", "--seed", "1",
            "--sglang-enable-torch-compile", "--sglang-tp=2"]  # fmt: skip
    assert _sglang_flags(argv) == [
        "train", "c.yaml", "--seed", "1", "--rollout.engine.server-args",
        json.dumps(["--mem-fraction-static", "0.8", "--enable-torch-compile", "--tp=2"]),
    ]  # fmt: skip
    # A switch before the config file does not take the file as its value.
    assert _sglang_flags(["train", "--sglang-enable-x", "c.yaml"]) == [
        "train", "c.yaml", "--rollout.engine.server-args", json.dumps(["--enable-x"])
    ]  # fmt: skip
    cfg = EngineConfig(type="sglang", serve="actor", model_path="m", server_args=["--tp", "2"])
    command = sglang_command(cfg, "127.0.0.1", 31000)
    assert command[1:3] == ["-m", "asyncrl.runtime.tether"]
    assert command[4:6] == ["-m", "sglang.launch_server"]
    assert command[6:] == ["--model-path", "m", "--host", "127.0.0.1", "--port", "31000",
                           "--tp", "2"]  # fmt: skip
    # The job's seed and the actor's name give each server its own, replayable stream.
    seeds = [sglang_command(cfg, "h", 1, f"0/{n}") for n in ("engine-0", "engine-0", "engine-1")]
    values = [c[c.index("--random-seed") + 1] for c in seeds]
    assert values[0] == values[1] != values[2] and all(v.isdigit() for v in values)
    own = cfg.model_copy(update={"server_args": ["--random-seed=7"]})
    assert sglang_command(own, "h", 1, "0/engine-0").count("--random-seed") == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rollout.engine.serve", "actor"], "--update-weight-transport disk"),
        (["--rollout.engine.server-args", "[--tp, 2]"], "launched sglang and vllm servers only"),
        (["--rollout.engine.type", "vllm"], "vllm engine type needs urls"),
        (
            [*VLLM, "--rollout.engine.server-args", "[--logprobs-mode, raw_logprobs]"],
            "asyncrl sets these itself",
        ),
        ([*VLLM, "--rollout.engine.vllm-python", "/no/python"], "/no/python is not an exec"),
        (["--rollout.engine.vllm-python", "/usr/bin/python3"], "launched vllm servers only"),
        ([*VLLM, "--rollout.sampling", "{temperature: 1.0, top_p: 0.9}"], "sets top_p: a vLLM"),
        ([*VLLM_URLS, "--rollout.num-actors", "2"], "takes one client"),
        ([*VLLM_URLS, "--rollout.engine.model-path", "", *EVAL_SET], "eval beside vLLM"),
        (["--rollout.engine.type", "sglang"], "or serve: actor"),
        (["--rollout.engine.urls", "[http://x:1]", "--rollout.engine.serve", "actor"], "urls"),
        (["--eval.engine.model-path", "m", "--eval.engine.serve", "actor"], "eval actor embeds"),
        ([*SGLANG, "--rollout.engine.server-args", "[--port, 1]"], "assigns these itself"),
        ([*SGLANG, "--rollout.engine.server-args", "[--tp, 2]", *DIST], "2 tensor-parallel"),
        ([*URLS, "[http://x:1, http://y:2]", *DIST], "one server: 2 urls"),
        ([*URLS, "[http://10.0.0.5:1]", *DIST, "--rollout.num-actors", "1"], "on this host"),
        ([*URLS, "[http://x:1]", "--rollout.engine.router", "true", *DIST], "not through a router"),
        (["--runtime.ray.roles", "{rollout: {resources: {GPU: 1}}}"], "use num_cpus / num_gpus"),
        (["--runtime.ray.roles", "{trainer: {num_gpus: 1.5}}"], "whole GPUs, not 1.5"),
        (["--runtime.ray.roles", "{trainer: {num_cpus: .nan}}"], "finite number"),
    ],
)
def test_engine_actor_configs_that_cannot_work_are_refused(flags: list[str], message: str):
    base = ["--rollout.engine.model-path", "m"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=[*base, *flags])


async def test_a_launched_server_is_served_health_checked_and_stopped(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PYTHONPATH", str(STUB))
    monkeypatch.setenv("ASYNCRL_TEST_ARGV", str(tmp_path / "argv.json"))
    actor = engine_actor(
        model, api_key="k3y", type="sglang", server_args=["--tp", "1"], health_interval=0.2
    )
    task = await running(actor)
    record = json.loads((tmp_path / "argv.json").read_text())
    argv = record["argv"]
    assert argv[argv.index("--model-path") + 1] == str(model)
    assert argv[-4:] == ["--tp", "1", "--api-key", "k3y"]  # the job's key, last
    async with actor.session.post(f"{actor.url}/generate", json={"input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 3}}) as resp:  # fmt: skip
        assert resp.status == 200 and len((await resp.json())["output_ids"]) == 3
    async with aiohttp.ClientSession() as anyone:  # no key: refused
        async with anyone.post(f"{actor.url}/generate", json={"input_ids": [1]}) as resp:
            assert resp.status == 401
    actor.request_stop("test")
    assert await task == 0
    for pid in (record["pid"], record["helper"]):  # the whole group was stopped
        assert not _alive(pid), pid


def test_a_tethered_command_dies_with_its_parent(tmp_path: Path):
    """``runtime/tether.py``: the server an engine actor started does not outlive it, nor
    does any process the server started (vLLM's engine core, SGLang's schedulers)."""
    server = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'asyncrl.runtime.tether', "
        f"sys.executable, '-c', {server!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    tether, grandchild = int(parent.stdout.readline()), int(parent.stdout.readline())
    assert _alive(tether) and _alive(grandchild)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while (_alive(tether) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tether)
    assert not _alive(grandchild)  # the exec-ing tether left this one running


def _alive(pid: int) -> bool:
    """Running (a zombie, reaped by no one yet, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_server_that_dies_fails_the_actor_with_the_reason(model: Path):
    actor = engine_actor(model, type="torch", health_interval=0.1, unhealthy_after_s=0.5)
    task = await running(actor)
    await actor.server.stop()  # the server goes away under the actor
    async with asyncio.timeout(30):
        assert await task == 1
    assert actor.state == "failed"


async def test_a_server_unhealthy_for_less_than_the_limit_is_kept(
    model: Path, monkeypatch: pytest.MonkeyPatch
):
    """A server may block for a while (joining a weight group blocks vLLM and SGLang until
    every rank arrives): the actor fails only once no check has passed for
    ``unhealthy_after_s``, however many failed in a row."""
    actor = engine_actor(model, type="torch", health_interval=0.05, unhealthy_after_s=1.5)
    task = await running(actor)
    checks: list[float] = []
    answers = iter([False] * 10 + [True])  # about 0.5 s without a pass, then one

    async def healthy(*, limit_s: float, **_: object) -> bool:
        checks.append(time.monotonic())
        return next(answers, False)  # then never again

    monkeypatch.setattr(actor, "_healthy", healthy)
    async with asyncio.timeout(30):
        assert await task == 1
    assert actor.state == "failed"
    failing = checks[11:]  # the checks after the one that passed
    assert len(failing) >= 3 and failing[-1] - checks[10] >= 1.5
    assert failing[-2] - checks[10] < 1.5  # it failed at the first check past the limit


async def test_a_server_that_never_starts_fails_with_its_last_output(
    model: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PYTHONPATH", str(STUB))
    actor = engine_actor(model, type="sglang", server_args=["--fail-at-start"])
    with pytest.raises(RuntimeError, match=r"exited with code 1.*asked to fail at start"):
        async with actor._stack:
            await actor.setup()


@pytest.mark.slow
async def test_a_killed_engine_actor_is_restarted_and_nothing_is_lost(model: Path, tmp_path: Path):
    """Its successor takes the trainer's weights by shared memory (CUDA IPC's CPU path);
    the same kill with disk weights is tests/test_chaos.py's, with a broadcast group
    tests/test_vllm.py's."""
    (tmp_path / "model").symlink_to(model)
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    run_dir = tmp_path / "run"
    # The victim serves the only producer: the run can only finish through its successor,
    # so a few steps after the kill (at step 1 or 2) prove that it came back and served;
    # beside a second engine they did not, however many steps the run took.
    steps = 12
    flags = [
        *job_flags(tmp_path, steps=steps), *LONG_RUN,
        *["--rollout.num-actors", "1", "--rollout.engine.model-path", str(model)],
        *["--rollout.engine.serve", "actor", "--update-weight-transport", "ipc"],
    ]  # fmt: skip
    victim, result = await kill_mid_run(run_dir, "engine-0", flags)
    assert result.ok, result.error
    assert result.steps == steps
    assert "engine-0: killed by SIGKILL" in result.restarts, result.restarts
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == steps * 2 and accounted(last)
    # The second engine incarnation served and took the trainer's weights.
    log = [json.loads(x) for x in lines(run_dir / "logs" / "engine-0.jsonl")]
    assert any(r["pid"] != victim and r["event"] == "weights updated" for r in log), result.restarts
    # /update_weights_from_tensor with the trainer's handles
    rows = [json.loads(x) for x in lines(run_dir / "metrics" / "rollout-0.jsonl")]
    assert rows[-1]["rollout/weights_shared"] >= 1, rows[-1]
