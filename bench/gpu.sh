#!/usr/bin/env bash
# Every GPU check in one call, for a session lent a device (it has 15 minutes of device
# time, start-up included, so each step has its own time limit and a failed step does
# not stop the others). Results and logs go to $OUT; docs/benchmarks.md ("On a GPU")
# holds what they gave.
#
# The device's image has torch, transformers and peft but not our other dependencies:
# carry them as Python 3.12 wheels in .whl/ (pyzmq, msgspec, pydantic, pydantic-core,
# typing-inspection, annotated-types, typing-extensions, structlog, transformers, and for
# TRL: trl, datasets, dill, multiprocess; jsonschema, referencing, rpds-py and
# jsonschema-specifications for the job; pytest-asyncio for the tests), and SmolLM2's
# config and tokenizer in .gpu/smol/: its weights (a 98 MB file) do not travel, so the
# benches run a model of its shape with random weights, which costs the same compute.
#
# bench/gpu_prepare.sh builds both here, before any device time is spent. Then:
#   run(command="bash bench/gpu.sh", carry=[".whl", ".gpu/smol"], timeout_s=540)
# At most 8 files come back from $OUT: summary.txt, and logs.tgz with every step's log and
# JSON (py-spy's wheel in .whl/ adds a sample of the engine's Python stacks).
set -u
OUT=${OUT:-/tmp/asyncrl-gpu}
LOGS=/tmp/asyncrl-gpu-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__,
    'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/summary.txt"

SMOL=/tmp/smollm2-shape
# SmolLM2-1.7B's shape (its config's sizes; random weights, bf16): the engine and trainer
# targets of issue 50 are set on it.
BIG=/tmp/smollm2-1.7b-shape
python3 - "$SMOL" "$BIG" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM

SRC = Path(".gpu/smol")
BIG = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
       "num_attention_heads": 32, "num_key_value_heads": 32,
       "max_position_embeddings": 8192, "rope_theta": 130000.0}


def build(out: Path, sizes: dict, **kwargs) -> None:
    """A random-weight model of SmolLM2's config with ``sizes``, its tokenizer beside it."""
    cfg = AutoConfig.from_pretrained(SRC)
    cfg.update(sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **kwargs)
    model.save_pretrained(out)
    for f in SRC.iterdir():
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    print(out, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")


build(Path(sys.argv[1]), {})
with torch.device("cuda"):  # 1.7B initialised on the CPU would take a minute
    build(Path(sys.argv[2]), BIG, dtype=torch.bfloat16)
EOF

step() {  # step NAME SECONDS COMMAND...: its log into logs.tgz, its tail here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 14 "$LOGS/$name.log"
    tar czf "$OUT/logs.tgz" -C "$LOGS" .  # after every step: a cut-short run keeps the rest
}
left() { [ $((480 - SECONDS)) -gt "$1" ]; }  # whether $1 s of the 8 minutes remain

# In order of need: a step cut short by the device time left loses only what follows it.
step pytest 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
# The engine with CUDA graphs (the default on CUDA) against eager decode and HF generate.
ENGINE="--device cuda --skip vllm vllm-server unpacked hf-forward --requests 64 --batch 64"
step engine 80 python3 bench/engine.py $ENGINE --model "$SMOL" --median 16 --tail 12 \
    --uniform 64 --out "$LOGS/engine.json"
step engine_17b 100 python3 bench/engine.py $ENGINE --model "$BIG" --median 16 --tail 12 \
    --uniform 64 --out "$LOGS/engine_17b.json"
# The real-model example's job on a model of SmolLM2's shape (random weights: no reward,
# so no filter, and the figures are speed alone).
step job 60 python3 -m asyncrl.cli train examples/word_problems/config.yaml --name gpu \
    --trainer.model-path "$SMOL" --trainer.device cuda --rollout.engine.device cuda \
    --trainer.dtype bf16-mixed --update-weight-transport ipc --train.num-steps 6 \
    --eval.interval 0 --buffer.filters '[]' --save-interval 2 --overwrite
cp runs/gpu/metrics.jsonl "$LOGS/job_metrics.jsonl" 2>/dev/null; cp -r runs/gpu/logs "$LOGS/job_logs" 2>/dev/null
# Beside a GPU the interval checkpoints are written in the background: each says so.
echo "job: background checkpoints written $(grep -c '"checkpoint written"' runs/gpu/logs/trainer.jsonl 2>/dev/null)" | tee -a "$OUT/summary.txt"
step real_trainer_17b 100 python3 bench/real_trainer.py --device cuda --model "$BIG" \
    --dtype bf16-mixed --groups 16 --budget 8192 --steps 2 \
    --variants packed,trl-onpolicy --out "$LOGS/real_trainer_17b.json"
left 90 && step train_backends 90 python3 bench/train_backends.py --device cuda --size 0.5b \
    --steps 2 --out "$LOGS/train_backends.json"
left 60 && step weight_sync 60 python3 bench/weight_sync.py --device cuda --versions 3 \
    --rounds 1 --out "$LOGS/weight_sync.json"
# trainer.compile (the MLPs and norms compiled): its first step compiles, the best is read.
left 90 && step real_trainer_17b_compiled 90 python3 bench/real_trainer.py --device cuda \
    --model "$BIG" --dtype bf16-mixed --groups 16 --budget 8192 --steps 3 \
    --variants compiled --out "$LOGS/real_trainer_17b_compiled.json"
left 60 && step real_trainer_profile 60 python3 bench/real_trainer.py --device cuda \
    --model "$BIG" --dtype bf16-mixed --groups 16 --budget 8192 --steps 1 --variants packed \
    --profile --out /tmp/real_trainer_profile.json
cat "$OUT/summary.txt"
