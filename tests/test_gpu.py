"""The CUDA paths, on a GPU: skipped where torch sees none (CI never has one).

``bench/gpu.sh`` runs this file on a lent device. Each test has a CPU twin that CI runs:
the engine's log-probs against the trainer's (test_logprob_agreement.py), the bf16-mixed
step (test_torch_trainer.py), and the ipc transport, whose buckets are named shared
memory on a CPU and device memory passed by CUDA IPC handle on a GPU
(test_weight_sync.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.policies import PolicyConfig
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.weights.sync import WeightReceiver
from tests.test_logprob_agreement import _check, _generate
from tests.test_weight_sync import publisher, same, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 11], list(range(20, 40)), [300, 7]]

# A receiver in its own process, as an engine colocated on the GPU: each version lands in
# device tensors it allocated; it prints the float64 sum of each.
RECEIVER = """
import asyncio, json, sys
import torch
from asyncrl.weights.sync import WeightReceiver

async def main(pub, snap, last):
    async with WeightReceiver(pub, snap, puller="gpu") as rx:
        print("READY", flush=True)
        seen = 0
        while seen < last:
            msg = await asyncio.wait_for(rx.next_version(after=seen), 60)
            out = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device="cuda")
                   for e in msg.manifest.entries}
            await rx.fetch(msg, out=out)
            sums = {k: float(v.double().sum()) for k, v in out.items()}
            print(json.dumps({"version": msg.version, "transport": msg.transport,
                              "sums": sums}), flush=True)
            seen = msg.version

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def test_the_cuda_trainer_recomputes_the_cuda_engines_log_probs(tiny_dir):
    _check(tiny_dir, PROMPTS, n=2, device="cuda")


async def test_plain_rows_sampled_on_the_gpu_report_their_log_probs_under_z_over_t(tiny_dir):
    """Rows with no truncation are sampled on the logits' device (sampling.py): each
    reported log-prob is log_softmax(z / T) of a teacher-forced forward at that token."""
    from transformers import AutoModelForCausalLM

    from asyncrl.engines.base import GenerateRequest, SamplingParams
    from asyncrl.engines.torch.engine import TorchEngine

    engine = TorchEngine.from_pretrained(str(tiny_dir), device="cuda")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).to("cuda").eval()
    task = asyncio.create_task(engine.run())
    try:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True,
                                    sampling_seed=i)  # fmt: skip
            request = GenerateRequest(rid=f"p{i}", input_ids=prompt, sampling=params)
            out = [o async for o in engine.generate(request)][-1]
            with torch.no_grad():
                ids = torch.tensor([prompt + out.output_ids], device="cuda")
                z = model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
            want = torch.log_softmax(z, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            assert torch.allclose(torch.tensor(out.logprobs), want.cpu(), atol=1e-4)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_bf16_mixed_step_on_the_gpu_trains_and_exports_its_live_weights(tiny_dir):
    batch = asyncio.run(_generate(tiny_dir, PROMPTS, 4, device="cuda"))
    cfg = TorchTrainer.Config(model_path=str(tiny_dir), lr=1e-3, device="cuda",
                              dtype="bf16-mixed")  # fmt: skip
    trainer = TorchTrainer(cfg, PolicyConfig())
    before = trainer.export_weights()
    assert {t.device.type for t in before.values()} == {"cpu"}
    metrics = trainer.train_step(batch).metrics
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    live = trainer.export_weights(copy=False)
    assert {t.device.type for t in live.values()} == {"cuda"}
    assert {t.dtype for t in live.values()} == {torch.float32}  # fp32 master weights
    assert any(not torch.equal(live[k].cpu(), before[k]) for k in before)


async def test_cuda_ipc_versions_reach_a_receiver_process_on_the_gpu(tmp_path):
    """Four versions: the ring of three shared slots is refilled by the fourth."""
    pub, blob, sync = await publisher("ipc", tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RECEIVER, pub.endpoint, pub.snapshot_endpoint, "4",
        stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() == b"READY"
        await asyncio.sleep(0.5)  # subscribed
        for version in (1, 2, 3, 4):
            tensors = {k: v.cuda() for k, v in weights(version).items()}
            msg = await sync.publish(version, tensors)
            assert msg.transport == "ipc" and msg.handles
            got = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            want = {k: float(v.double().sum()) for k, v in tensors.items()}
            assert got == {"version": version, "transport": "ipc", "sums": want}
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        # Off the host (or too late for the slot) a receiver pulls: the blob server copies
        # the device buckets to the host a chunk at a time.
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint, shared=False) as rx:
            msg = await asyncio.wait_for(rx.next_version(after=3), 10)
            assert same(await rx.fetch(msg), weights(4)) and rx.counts["pulled"] == 1
    finally:
        if proc.returncode is None:
            proc.kill()
        sync.close()
        await blob.aclose()
        await pub.aclose()


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("retract", [False, True])
async def test_cuda_graph_decode_gives_the_eager_paths_tokens(tiny_dir, seeded, retract):
    """Graphs captured per (batch, span) bucket replay the eager path's steps: the same
    tokens, log-probs within 1e-4 (CPU twin: test_graph_decode.py, eagerly)."""
    from asyncrl.engines.torch.engine import TorchEngine
    from tests.test_graph_decode import outputs, requests

    engines = [
        TorchEngine.from_pretrained(str(tiny_dir), device="cuda", max_running=8, cuda_graph=g)
        for g in (False, True)
    ]
    assert engines[1].scheduler.batch.decoder.graphs_on
    eager, graphed = [await outputs(e, requests(seeded), retract) for e in engines]
    for e, g in zip(eager, graphed, strict=True):
        assert g.output_ids == e.output_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs, strict=True)) < 1e-4
    decoder = engines[1].scheduler.batch.decoder
    assert decoder.graphs  # captured, and replayed since
    # A weight update writes the parameters in place: the graphs stay and read it.
    captured = dict(decoder.graphs)
    task = asyncio.create_task(engines[1].run())
    try:
        state = {k: v.clone() for k, v in engines[1].model.state_dict().items()}
        await engines[1].update_weights_from_tensors(state, 1)
    finally:
        task.cancel()
    again = await outputs(engines[1], requests(seeded), retract)
    assert [o.output_ids for o in again] == [o.output_ids for o in graphed]
    assert all(decoder.graphs.get(k) is g for k, g in captured.items())
