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
#   run(command="bash bench/gpu.sh", carry=[".whl", ".gpu"], timeout_s=580)
# At most 8 files come back from $OUT: the logs hold the results.
set -u
OUT=${OUT:-/tmp/asyncrl-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__,
    'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/summary.txt"

SMOL=/tmp/smollm2-shape
python3 - "$SMOL" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM

out, src = Path(sys.argv[1]), Path(".gpu/smol")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
model.save_pretrained(out)
for f in src.iterdir():
    if not (out / f.name).exists():
        shutil.copy(f, out / f.name)
print("random-weight SmolLM2 shape:", sum(p.numel() for p in model.parameters()) / 1e6, "M")
EOF

step() {  # step NAME SECONDS COMMAND...: its log under $OUT, its tail here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 18 "$OUT/$name.log"
}

# In order of need: a step cut short by the device time left loses only what follows it.
step pytest 50 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
step weight_sync 100 python3 bench/weight_sync.py --device cuda --versions 3 --rounds 1 \
    --out "$OUT/weight_sync.json"
step job 50 python3 -m asyncrl.cli train examples/arith/config.yaml --name gpu \
    --trainer.device cuda --rollout.engine.device cuda --update-weight-transport ipc \
    --train.num-steps 12 --eval-interval 0 --overwrite
tail -n 3 runs/gpu/metrics.jsonl >>"$OUT/job.log" 2>/dev/null
step engine 120 python3 bench/engine.py --device cuda --model "$SMOL" --skip vllm \
    --requests 64 --batch 64 --median 16 --tail 12 --uniform 32 --profile \
    --out /tmp/engine.json
step real_trainer 150 python3 bench/real_trainer.py --device cuda --model "$SMOL" \
    --dtype bf16-mixed --groups 16 --budget 8192 --steps 2 \
    --variants packed,padded,trl-onpolicy --out /tmp/real_trainer.json
step real_trainer_profile 60 python3 bench/real_trainer.py --device cuda --model "$SMOL" \
    --dtype bf16-mixed --groups 16 --budget 8192 --steps 1 --variants packed --profile \
    --out /tmp/real_trainer_profile.json
cat "$OUT/summary.txt"
