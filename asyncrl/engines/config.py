"""``EngineConfig``: which engines a rollout actor uses and how they are built (the
``rollout.engine`` config section, ``asyncrl serve``'s flags, ``TorchEngine.from_config``).

No torch and no HTTP imports here: the config tree and ``asyncrl --help`` read it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from asyncrl.engines.sim.latency import LatencyModel
from asyncrl.hardware import low_precision_pays

#: Arguments of sglang.launch_server that the engine actor sets (model_path, its endpoint).
_ASSIGNED_SERVER_ARGS = ("--model-path", "--model", "--host", "--port")


def sampled_dtype(trainer_dtype: str, model_path: str | None, device: str = "cpu") -> str:
    """An engine's weights for a trainer's compute precision (bf16-mixed computes in
    bfloat16), so that what is sampled is what is trained; float32 where the engine's
    own device would emulate the low precision (a CPU engine beside a GPU trainer)."""
    dtype = {"bf16-mixed": "bfloat16"}.get(trainer_dtype, trainer_dtype)
    if dtype == "float32" or low_precision_pays(model_path, device):
        return dtype
    return "float32"


class EngineConfig(BaseModel):
    """Which engines a rollout actor uses and how they take new weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    type: Literal["torch", "sglang", "vllm", "sim"] = Field(
        "torch",
        description="embedded torch, SGLang, vLLM (its own API: engines/vllm/engine.py), "
        "or sim (no model: modelled time)",
    )
    model_path: str | None = Field(
        None,
        description="HF model directory (torch engine; launched sglang and vllm servers; "
        "vllm urls: a local copy for the tokenizer; sim: its vocab and EOS).",
    )
    sim: LatencyModel = Field(
        default_factory=LatencyModel, description="the sim engine's latency model"
    )
    sim_engines: int = Field(
        1, ge=1, description="sim engines in each rollout actor (one server each)"
    )
    in_process: bool = Field(
        True,
        description="embedded engines (torch, sim): non-stream /generate calls skip the "
        "loopback HTTP (false: every call goes over HTTP, as to SGLang)",
    )
    device: str = Field("cpu", description="torch device of the embedded engine.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights; auto: in a job, the trainer's precision (bfloat16 where it "
        "computes in bf16); alone, the trainer's rule (hardware.low_precision_pays)",
    )
    _dtype_was_auto: bool = PrivateAttr(False)
    max_running: int = Field(64, ge=1, description="Requests decoded together (torch engine).")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="torch engine: KV positions held at once, padding included (rows x the "
        "longest row's final length); None: what mem_fraction of the free memory holds",
    )
    mem_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        description="torch engine, no max_total_tokens: the share of the memory free at its "
        "start (the host's, or the GPU's) that its KV cache may take at its peak",
    )
    prompt_cache_tokens: int = Field(
        4096,
        ge=0,
        description="torch engine: prompt positions whose KV is kept for requests that "
        "repeat the prompt exactly (a group's samples: one prefill for n), least recently "
        "used first out, cleared when the weights change; 0: off. Held beside the KV budget",
    )
    packed_weights: bool = Field(
        True,
        description="torch engine on the CPU: keep a oneDNN-packed copy of each linear "
        "weight (1.3-2x faster matmuls, for a second copy of those weights; "
        "engines/torch/cpu_linear.py)",
    )
    lean_forward: bool = Field(
        True,
        description="torch engine: run Llama and Qwen2 models through asyncrl's own forward "
        "(fused projections, no per-module Python; engines/torch/lean_forward.py); false, or "
        "another architecture: through transformers",
    )
    cuda_graph: bool = Field(
        True,
        description="torch engine on CUDA: decode on a static KV pool, each batch bucket "
        "a captured CUDA graph (engines/torch/graph_decode.py); false (SGLang's "
        "--disable-cuda-graph): eager decode on a growing cache",
    )
    json_any_whitespace: bool = Field(
        True,
        description="torch engine, json_schema requests: allow any whitespace between JSON "
        "tokens, as SGLang by default; false (SGLang's "
        "--constrained-json-disable-any-whitespace): compact JSON, which a small model "
        "cannot pad until it runs out of tokens",
    )
    seed: int | None = Field(
        None,
        description="torch engine: the stream its requests' sampling seeds come from, "
        "mixed with the actor's name (a restarted actor draws afresh); None: the job's seed",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="server URLs (sglang; vllm: servers started with "
        "asyncrl's arguments, engines/vllm/launch.py)",
    )
    vllm_python: str | None = Field(
        None,
        description="vllm, serve: actor: the interpreter of vLLM's virtualenv (default: "
        "$ASYNCRL_VLLM_PYTHON, else .venv-vllm/bin/python from `make vllm-venv`)",
    )
    router: bool = Field(False, description="The one URL is an sglang-router.")
    on_update: Literal["continue", "abort"] = Field(
        "continue", description="In-flight requests on a weight update: continue or abort."
    )
    update_in_place: bool = Field(
        True,
        description="torch engine, pull and dist: write a new version straight into the "
        "model, decoding paused for the transfer (false: stage a full copy first, then "
        "pause only to swap it in: a shorter pause for a model's worth of memory)",
    )
    serve: Literal["embedded", "actor"] = Field(
        "embedded",
        description="embedded: the torch engine runs in the rollout actor; actor: each "
        "rollout actor gets an engine actor (torch, or an SGLang or vLLM server it "
        "launches)",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="extra arguments of the launched server (serve: actor): "
        "sglang.launch_server's (--sglang-* flags), or vLLM's api_server's",
    )
    health_interval: float = Field(
        5.0, gt=0, description="seconds between an engine actor's /health_generate checks"
    )
    unhealthy_after_s: float = Field(
        180.0,
        gt=0,
        description="an engine actor fails (for its supervisor to restart it) once its "
        "engine has passed no health check for this long (and failed 3 in a row): longer "
        "than a weight-group join, which blocks a server until every rank arrives (the "
        "embedded and vLLM engines wait up to 120 s)",
    )
    startup_timeout: float = Field(
        900.0, gt=0, description="seconds an engine actor's server has to become healthy"
    )
    health_check_s: float | None = Field(
        30.0,
        gt=0,
        description="sglang and vllm urls: check each engine with /health_generate this "
        "often; one "
        "that fails leaves the rotation and rejoins, given the current weights first, once "
        "it passes again (null: only failed calls take an engine out)",
    )

    @field_validator("server_args", mode="before")
    @classmethod
    def _as_text(cls, args: Any) -> Any:
        """``[--tp, 2]`` in YAML holds a number: a command line is text."""
        if isinstance(args, list):
            return [a if isinstance(a, str) else json.dumps(a) for a in args]
        return args

    def seeded(self, seed: int, resumed_at: int | None = None) -> EngineConfig:
        """This engine sampling from the job's ``seed`` unless it names its own: a rerun
        replays its draws, another seed draws others (``rollout/engines.py::engine_seed``).
        A job resumed after step ``resumed_at`` samples from that seed mixed with the step:
        a stream of its own, not a replay of the first run's draws on new prompts (the same
        resume point replays the same stream)."""
        own = self if self.seed is not None else self.model_copy(update={"seed": seed})
        if resumed_at is None:
            return own
        mixed = zlib.crc32(f"{own.seed}/resumed-after-{resumed_at}".encode())
        return own.model_copy(update={"seed": mixed})

    @model_validator(mode="after")
    def _dtype_for_the_machine(self) -> EngineConfig:
        """``auto`` left by the job (an engine alone: ``asyncrl serve``, ``asyncrl eval``)
        becomes this machine's choice, as a trainer's would."""
        if self.dtype == "auto":
            pays = self.type != "sim" and low_precision_pays(self.model_path, self.device)
            self.dtype = "bfloat16" if pays else "float32"
            self._dtype_was_auto = True  # a job's config makes it follow its trainer
        return self

    @model_validator(mode="after")
    def _sim_is_embedded(self) -> EngineConfig:
        if self.type != "sim":
            return self
        if self.serve != "embedded" or self.urls:
            raise ValueError("the sim engine runs embedded in the rollout actor: no urls, serve")
        if self.model_path:
            sim_shape(self.model_path)  # its vocabulary and EOS: refused now, not at launch
        return self

    @model_validator(mode="after")
    def _complete(self) -> EngineConfig:
        if (self.type == "torch" or self.serve == "actor") and not self.model_path:
            raise ValueError(f"the {self.type} engine needs model_path (an HF model directory)")
        if self.serve == "actor" and self.urls:
            raise ValueError(
                "serve: actor starts its own engines; urls are for engines started elsewhere"
            )
        if self.type in ("sglang", "vllm") and self.serve == "embedded" and not self.urls:
            raise ValueError(
                f"the {self.type} engine type needs urls (server addresses), or serve: actor"
            )
        if self.type == "vllm" and self.router:
            raise ValueError("router: the one url is an sglang-router; vLLM servers are listed")
        taken = [a for a in self.server_args if a.split("=")[0] in _ASSIGNED_SERVER_ARGS]
        if taken:
            raise ValueError(f"server_args {taken}: the engine actor assigns these itself")
        if self.server_args and not (self.type in ("sglang", "vllm") and self.serve == "actor"):
            raise ValueError("server_args apply to launched sglang and vllm servers only")
        if self.type == "vllm":
            from asyncrl.engines.vllm.launch import check_extra

            check_extra(self.server_args)
        if self.vllm_python and not (self.type == "vllm" and self.serve == "actor"):
            raise ValueError("vllm_python is the interpreter of launched vllm servers only")
        if self.vllm_python:
            from asyncrl.engines.vllm.launch import vllm_python

            try:
                vllm_python(self.vllm_python)
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None

        return self


def sim_shape(model_path: str) -> dict[str, int]:
    """``vocab_size`` and ``eos_token_id`` of ``model_path``'s ``config.json`` (a sim
    engine's tokens must fit the model that is trained on them); ``ValueError`` naming the
    file when it has no vocabulary."""
    path = Path(model_path).expanduser() / "config.json"
    try:
        hf = json.loads(path.read_text())
        shape = {"vocab_size": int(hf["vocab_size"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"the sim engine takes its vocabulary from {path}, which has none "
            f"({type(exc).__name__}: {exc})"
        ) from None
    eos = hf.get("eos_token_id")
    if eos is not None:
        shape["eos_token_id"] = int(eos[0] if isinstance(eos, list) else eos)
    return shape
