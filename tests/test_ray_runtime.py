"""The Ray runtime on a simulated three-node cluster (``ray.cluster_utils.Cluster``): actors
land on the nodes their placement asks for, channels cross nodes, a short training run
accounts for every prompt as the local runtime does, a job the cluster cannot hold is
refused before any actor starts, engine actors serve rollout actors placed beside them,
and a rollout actor whose Ray worker is SIGKILLed is restarted with its work requeued, the
run going on to its last step.

One module-scoped cluster: a head with the ``head`` resource and two workers with
``node_a`` and ``node_b``, so a role pinned to a resource has exactly one node to go to.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import RayConfig, load_config
from asyncrl.job import run_job
from asyncrl.observe.logs import configure_logging
from asyncrl.runtime.dryrun import dry_run
from asyncrl.runtime.ray import ActorHost, RayRuntime
from asyncrl.wire import security
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

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

PINNED = (
    "{buffer: {resources: {head: 1}}, trainer: {num_cpus: 1, resources: {node_a: 1}},"
    " rollout: {num_cpus: 0.5, resources: {node_b: 1}}}"
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """Three nodes on this machine; yields resource name -> node id."""
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    nodes.add_node(num_cpus=1, resources={"node_a": 1})
    nodes.add_node(num_cpus=1, resources={"node_b": 2})
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        ids = {
            key: node["NodeID"]
            for node in ray.nodes()
            for key in ("head", "node_a", "node_b")
            if key in node["Resources"]
        }
        yield ids
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray_job")
    build_tiny_model(root / "model")
    write_prompts(root / "prompts.jsonl", n=64)
    return root


def ray_job_flags(root: Path, run: str, steps: int) -> list[str]:
    flags = job_flags(root, steps=steps)
    flags[flags.index("--output-dir") + 1] = str(root / run)
    flags[flags.index("--rollout.num-actors") + 1] = "2"
    return [*flags, "--runtime", "ray", "--runtime.ray.roles", PINNED]


async def test_actors_land_where_their_placement_asks_and_channels_cross_nodes(
    cluster: dict[str, str], tmp_path: Path
):
    flags = ["--runtime", "ray", "--output-dir", str(tmp_path / "dry")]
    cfg = load_config(
        overrides=[*flags, "--rollout.num-actors", "2", "--runtime.ray.roles", PINNED]
    )
    result = await dry_run(cfg, count=32, deadline=60)
    assert result.ok, result.error
    nodes = {row["actor"]: row["node"] for row in result.rows}
    short = {key: node_id[:8] for key, node_id in cluster.items()}
    assert nodes == {
        "buffer": short["head"],
        "trainer": short["node_a"],
        "rollout-0": short["node_b"],
        "rollout-1": short["node_b"],
    }
    rows = {row["actor"]: row for row in result.rows}
    # Work and results crossed head <-> node_b, batches head <-> node_a, and the weights
    # (pub/sub, then a 33 KiB blob pull) node_a -> node_b.
    assert rows["buffer"]["work"] == rows["buffer"]["results"] == 64
    assert rows["trainer"]["batches"] == 32
    assert all(rows[f"rollout-{i}"]["version"] == 1 for i in range(2))
    assert all(rows[f"rollout-{i}"]["blob_kib"] > 0 for i in range(2))


async def test_a_job_the_cluster_cannot_hold_is_refused_before_any_actor_starts(
    cluster: dict[str, str], tmp_path: Path
):
    roles = "{trainer: {num_gpus: 1}, rollout: {resources: {node_c: 1}}}"
    flags = ["--runtime", "ray", "--output-dir", str(tmp_path / "r"), "--runtime.ray.roles", roles]
    result = await dry_run(load_config(overrides=flags), deadline=30)
    assert not result.ok and result.rows == []
    assert "GPU: needs 1, has 0" in result.error and "node_c: needs 2, has 0" in result.error
    assert not (tmp_path / "r" / "logs" / "trainer.out").exists()


def test_a_cluster_across_hosts_binds_node_addresses_only_with_keys(
    cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    here = ray.util.get_node_ip_address()
    runtime = RayRuntime(tmp_path, RayConfig())
    assert runtime._bind_host() == "127.0.0.1"  # every node on this host: loopback
    nodes = ray.nodes()
    monkeypatch.setattr(
        ray, "nodes", lambda: [*nodes, {**nodes[0], "NodeManagerAddress": "10.9.8.7"}]
    )
    with pytest.raises(ValueError, match=r"spans hosts.*asyncrl keys"):
        runtime._bind_host()
    security.generate(tmp_path / "keys")
    security.enable(tmp_path / "keys")
    try:
        assert runtime._bind_host() is None and runtime.controller_host == here
    finally:
        security.disable()
    # With no host given, a node's ActorHost draws its ports on the node's own address.
    host = ray.remote(ActorHost).options(num_cpus=0).remote(str(tmp_path), str(tmp_path / "h.out"))
    try:
        [endpoint] = ray.get(host.endpoints.remote(["x"], None)).values()
    finally:
        ray.kill(host)
    assert endpoint.startswith(f"tcp://{here}:")


async def test_a_short_run_on_ray_trains_and_accounts_for_every_prompt(
    cluster: dict[str, str], model: Path
):
    result = await run_job(load_config(overrides=ray_job_flags(model, "plain", steps=3)))
    assert result.ok, result.error
    assert result.steps == 3 and result.restarts == []
    run_dir = model / "plain"
    steps = [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == 3 * 2 and accounted(last)
    assert (run_dir / "checkpoints" / "trainer" / "step_000003" / "trainer.json").exists()
    # Both producers ran (on node_b) and wrote their logs into the run directory.
    groups = 0
    for name in ("rollout-0", "rollout-1"):
        groups += json.loads(lines(run_dir / "metrics" / f"{name}.jsonl")[-1])["rollout/groups"]
        assert "actor running" in (run_dir / "logs" / f"{name}.out").read_text()
    assert groups >= 3 * 2


async def test_engine_actors_serve_their_rollout_actors_from_the_same_node(
    cluster: dict[str, str], model: Path
):
    roles = "{engine: {num_cpus: 0.5, resources: {node_a: 0.5}}, trainer: {resources: {head: 1}}}"
    flags = [
        *ray_job_flags(model, "engines", steps=3),
        *["--runtime.ray.roles", roles, "--rollout.engine.model-path", str(model / "model")],
        *["--rollout.engine.serve", "actor", "--update-weight-transport", "disk"],
    ]
    result = await run_job(load_config(overrides=flags))
    assert result.ok, result.error
    assert result.steps == 3 and accounted(last_buffer_metrics(model / "engines"))
    logs = model / "engines" / "logs"
    for name in ("engine-0", "engine-1", "rollout-0", "rollout-1"):
        first = (logs / f"{name}.out").read_text().splitlines()[0]
        assert first.startswith(f"asyncrl: ray node {cluster['node_a']}"), (name, first)


async def test_killing_a_rollout_actors_ray_worker_is_survived(
    cluster: dict[str, str], model: Path
):
    run_dir = model / "killed"
    # The victim is the only producer: the run can only finish through its successor, so
    # a few steps after the kill (at step 1 or 2) prove that it came back and produced;
    # beside a second producer they did not, however many steps the run took.
    steps = 12
    flags = [*ray_job_flags(model, "killed", steps=steps), *LONG_RUN, "--rollout.num-actors", "1"]
    victim, result = await kill_mid_run(run_dir, "rollout-0", flags)
    assert result.ok, result.error
    assert result.steps == steps
    [restart] = result.restarts
    assert restart.startswith("rollout-0: ray: ") and "worker" in restart, restart
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == steps * 2 and accounted(last)
    # The buffer took back the dead actor's work before its second incarnation started,
    # which ran in another worker and loaded the trainer's weights.
    requeues = [json.loads(x) for x in lines(run_dir / "logs" / "buffer.jsonl") if "requeued" in x]
    assert [r["actor"] for r in requeues] == ["rollout-0"]
    logs = [json.loads(line) for line in lines(run_dir / "logs" / "rollout-0.jsonl")]
    assert {r["pid"] for r in logs} - {victim}, "no second incarnation"
    assert any(r["pid"] != victim and r["event"] == "weights loaded" for r in logs)


def test_the_cli_dry_run_runs_on_ray(cluster: dict[str, str], tmp_path: Path, capsys):
    code = main(["train", "--runtime", "ray", "--output-dir", str(tmp_path / "r"), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dry run ok" in out
    configure_logging(stream=sys.__stderr__)  # not the capture stream pytest closes next
