#!/usr/bin/env bash
# The tool agent recipe (examples/tool_agent/config.yaml) on the lent GPU with the real
# warm-up model, which travels in parts (bench/gpu_pack.py: int8 rows, 3 calls of at most
# 64 MiB). The calls before this one install the wheels into /tmp/site and copy their
# parts to /tmp/pack; this one brings the last part:
#
#   .venv/bin/python bench/gpu_pack.py pack models/tool-agent-sft .gpu/agent
#   run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#       && mkdir -p /tmp/pack && cp -r .gpu/agent/* /tmp/pack/", carry=[".whl", ".gpu/agent/meta", ".gpu/agent/part0"])
#   run(command="cp .gpu/agent/part1 /tmp/pack/", carry=[".gpu/agent/part1"])
#   run(command="bash bench/gpu_agent.sh", carry=[".gpu/agent/part2"], timeout_s=560)
#
# $OUT gets summary.txt and agent.tgz (the run's metrics, samples and logs).
set -u
OUT=${OUT:-/tmp/asyncrl-gpu-agent}
mkdir -p "$OUT" /tmp/pack
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
cp .gpu/agent/part* /tmp/pack/ 2>/dev/null
ls -la /tmp/pack
python3 bench/gpu_pack.py unpack /tmp/pack /tmp/tool-agent-sft || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"

start=$SECONDS
timeout "${AGENT_S:-400}" python3 -m asyncrl.cli train examples/tool_agent/config.yaml \
    --name gpu_agent --overwrite --seed "${SEED:-0}" \
    --trainer.model-path /tmp/tool-agent-sft --rollout.engine.model-path /tmp/tool-agent-sft \
    --trainer.device cuda --rollout.engine.device cuda --rollout.engine.dtype bfloat16 \
    --trainer.dtype bf16-mixed --update-weight-transport ipc >/tmp/agent.log 2>&1
echo "agent rc=$? $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
tail -n 25 /tmp/agent.log | tee -a "$OUT/summary.txt"
cp /tmp/agent.log runs/gpu_agent/ 2>/dev/null
tar czf "$OUT/agent.tgz" --exclude checkpoints -C runs gpu_agent
python3 -c '
import json
for line in open("runs/gpu_agent/metrics/eval.jsonl"):
    r = json.loads(line)
    v, p, c, t = (r[k] for k in ("version", "pass@1", "tool_calls", "seconds"))
    print(f"eval v{v}: pass@1 {p:.3f}, tool calls {c:.2f}, {t:.0f} s")
' | tee -a "$OUT/summary.txt"

start=$SECONDS
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py >/tmp/pytest.log 2>&1
echo "pytest rc=$? $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
tail -n 5 /tmp/pytest.log | tee -a "$OUT/summary.txt"
