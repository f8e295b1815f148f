#!/usr/bin/env bash
# What bench/gpu.sh carries to a lent GPU machine, built here before any device time is
# spent: .whl/ (Python 3.12 x86-64 wheels of our dependencies its image lacks, at this
# venv's versions) and .gpu/smol/ (SmolLM2's config and tokenizer, not its weights).
# Both folders are in .git/info/exclude. Then, in one device call:
#   run(command="bash bench/gpu.sh", carry=[".whl", ".gpu/smol"], timeout_s=540)
set -eu
cd "$(dirname "$0")/.."
# What the last GPU sessions carried (bench/gpu.sh's header), with uvloop (the tests'
# loop), megatron-core and psutil (the megatron backend on the GPU).
PKGS="pyzmq msgspec pydantic pydantic_core typing-inspection annotated-types
typing_extensions structlog transformers trl datasets dill multiprocess jsonschema
referencing rpds-py jsonschema-specifications pytest-asyncio uvloop megatron-core psutil"
pins=$(.venv/bin/pip freeze 2>/dev/null | python3 -c "
import sys
want = {w.lower().replace('_', '-') for w in sys.argv[1].split()}
for line in sys.stdin:
    name = line.split('==')[0].lower().replace('_', '-')
    if '==' in line and name in want:
        print(line.strip())
" "$PKGS")
rm -rf .whl && mkdir -p .whl .gpu/smol
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl $pins py-spy
cp models/smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smol/
for d in .git/info/exclude; do
    grep -qx '/.whl/' $d || echo '/.whl/' >>$d
    grep -qx '/.gpu/' $d || echo '/.gpu/' >>$d
done
du -sh .whl .gpu/smol
