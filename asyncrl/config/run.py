"""``RunConfig``: the job's config tree, composing each component's section (trainer,
engines, rollout, buffer, algorithm, wire) with those of ``config/sections.py``; the checks
across sections; presets."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, model_validator

from asyncrl import hardware
from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.config.sections import (
    KeyConflict,
    LogConfig,
    RuntimeConfig,
    Section,
    TrainConfig,
)
from asyncrl.engines.config import EngineConfig, sampled_dtype
from asyncrl.policies.config import PolicyConfig
from asyncrl.rollout.config import EvalConfig, RolloutConfig
from asyncrl.rollout.reward_config import reward_models
from asyncrl.trainers.config import TrainerConfig
from asyncrl.weights.config import check_group_host
from asyncrl.wire.config import WireConfig
from asyncrl.wire.sockets import is_loopback

_TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size", "-tp")  # SGLang's, vLLM's


def _server_tp(args: list[str]) -> int:
    """The tensor-parallel size that ``sglang.launch_server`` arguments ask for (1 if none)."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in _TP_FLAGS:
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            return int(value) if value.isdigit() else 1
    return 1


def _as_dict(data: Any, key: str) -> dict[str, Any]:
    """``data[key]`` when both are plain dicts (raw config), else empty."""
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


class RunConfig(Section):
    """The root of a job's configuration: run identity plus one section per component."""

    name: str = Field("asyncrl", min_length=1, description="run name")
    output_dir: str = Field("runs/{name}", description="run directory; {name} is replaced")
    seed: int = Field(
        0,
        description="random seed of the job: the engines' sampling, and the prompts' shuffle "
        "and the trainer where data.seed and trainer.seed are not set",
    )
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="actor runtime")
    wire: WireConfig = Field(default_factory=WireConfig, description="channel limits")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout actors")
    trainer: TrainerConfig | None = Field(
        None,
        description="the trainer actor: model, optimizer, backend (needed to train; "
        "--hf-checkpoint sets the model)",
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="the training loop around the trainer: steps, checkpoints, weight "
        "publishing, audit",
    )
    buffer: VersionedBuffer.Config = Field(
        default_factory=VersionedBuffer.Config,
        description="admission, store, APRIL, filters",
    )
    data: PromptSource.Config | None = Field(
        None,
        description="training prompts (needed to train; --prompt-data sets the file)",
    )
    algo: PolicyConfig = Field(
        default_factory=PolicyConfig,
        description="RL objective: estimator, loss, KL, corrections",
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="held-out evaluation during training"
    )

    @model_validator(mode="before")
    @classmethod
    def _engines_serve_the_trained_model(cls, data: Any) -> Any:
        """An engine section (rollout's, eval's) without ``model_path`` serves
        ``--hf-checkpoint``'s model when it needs one (a torch engine, or engines launched
        as actors), as a job with no engine section does: ``--rollout.engine.in-process
        false`` alone must not ask for the path again."""
        model = _as_dict(data, "trainer").get("model_path")
        if not model:
            return data
        for name in ("rollout", "eval"):
            section = _as_dict(data, name)
            engine = _as_dict(section, "engine")
            needs = engine.get("type", "torch") == "torch" or engine.get("serve") == "actor"
            if engine and needs and not engine.get("model_path"):
                data = {
                    **data,
                    name: {**section, "engine": {**engine, "model_path": model}},
                }
        return data

    @model_validator(mode="after")
    def _engines_sample_at_the_trainers_precision(self) -> RunConfig:
        """An engine whose ``dtype`` was ``auto`` holds its weights in the trainer's
        compute precision (bfloat16 for bf16-mixed), so that what is sampled is what is
        trained; the trainer's own ``auto`` is this machine's choice."""
        if self.trainer is None:
            return self
        for engine in (self.rollout.engine, self.eval.engine):
            if engine is None or not engine._dtype_was_auto:
                continue
            dtype = sampled_dtype(self.trainer.dtype, engine.model_path, engine.device)
            if engine.dtype != dtype:
                engine.dtype = dtype
        return self

    @model_validator(mode="after")
    def _one_engine_where_two_would_overcommit_the_cores(self) -> RunConfig:
        """``rollout.num_actors`` unset is 2, but 1 (``max_groups`` unset: doubled, the
        same groups in flight) where a CPU trainer lends its idle cores
        (``lends_trainer_cores``) and there are fewer cores than the trainer, two engines
        and the eval actor: two engines would each run a thread beyond their share, taken
        from the computing trainer (25% slower steps on 2 cores: docs/benchmarks.md)."""
        served = self.rollout.engine is not None and self.rollout.engine.serve == "actor"
        if "num_actors" in self.rollout.model_fields_set or served:
            return self
        if self.trainer is None or self.trainer.device != "cpu" or not self.lends_trainer_cores():
            return self
        if reward_models(self.rollout.reward, *(s.reward for s in self.eval.sets)):
            return self
        if 1 + 2 + int(self.eval.enabled) > hardware.usable_cores():
            r = self.rollout
            update = {"num_actors": 1} | ({} if "max_groups" in r.model_fields_set else
                                         {"max_groups": 2 * r.max_groups})  # fmt: skip
            self.rollout = r.model_copy(update=update)
        return self

    def lends_trainer_cores(self) -> bool:
        """Whether the trainer lends its cores to the embedded engines while it waits
        (``runtime.lend_trainer_cores``; ``cores.py``): a local job that shares the cores
        itself (``runtime.threads`` unset) with a trainer and embedded CPU engines; with
        ``auto``, an engine model wide enough for more threads to pay."""
        rt, engine = self.runtime, self.rollout.engine
        on_cpu = engine is None or (engine.type == "torch" and engine.device == "cpu")
        shares = rt.type == "local" and rt.threads is None and on_cpu
        if rt.lend_trainer_cores == "never" or not shares or self.trainer is None:
            return False
        if self.train.debug_rollout_only or self.train.load_rollout_data:
            return False
        served = engine.model_path if engine else self.trainer.model_path  # role_configs
        return rt.lend_trainer_cores == "always" or hardware.wide_model(served)

    @model_validator(mode="after")
    def _the_job_seed_seeds_everything(self) -> RunConfig:
        """``seed`` seeds what does not name its own: the prompts' shuffle (``data.seed``)
        and the trainer (``trainer.seed``); the engines mix it with their actor names."""
        for section in (self.data, self.trainer):
            if section is not None and "seed" not in section.model_fields_set:
                section.seed = self.seed
        return self

    @model_validator(mode="after")
    def _eval_sets_render_like_the_data(self) -> RunConfig:
        """An eval set that does not say renders its prompts as the training data does: a
        chat model evaluated on raw text would be scored on a task it was not trained on."""
        for s in self.eval.sets:
            if s.apply_chat_template is None:
                s.apply_chat_template = bool(self.data and self.data.apply_chat_template)
        return self

    @model_validator(mode="after")
    def _one_reward_model(self) -> RunConfig:
        """One reward actor a job serves one reward model: two would each take its memory
        and threads beside the engines (give the eval sets the rollout's)."""
        models = reward_models(self.rollout.reward, *(s.reward for s in self.eval.sets))
        if len(models) > 1:
            paths = ", ".join(m.path for m in models)
            raise KeyConflict(
                f"a job serves one reward model, and its rewards name {len(models)} ({paths}): "
                "use the same model settings everywhere",
                ("rollout", "reward"),
            )
        return self

    @model_validator(mode="after")
    def _backend_trains_the_algo(self) -> RunConfig:
        if not self.trainer or self.trainer.backend != "megatron":
            return self
        if self.algo.needs_critic:
            raise KeyConflict(
                f"{self.algo.advantage_estimator} needs a critic, which the megatron backend "
                "does not train: use a critic-free estimator (grpo, rloo, "
                "reinforce_pp_baseline, ...) or --train-backend torch",
                ("algo", "advantage_estimator"),
            )
        return self

    @model_validator(mode="after")
    def _adapter_versions_reach_the_engines(self) -> RunConfig:
        """Only the embedded torch engine merges adapter-only versions (lora_merge.py),
        which reach it by any transport."""
        lora = self.trainer.lora if self.trainer is not None else None
        if lora is None or not lora.enabled or lora.publish != "adapters":
            return self
        engines = [e for e in (self.rollout.engine, self.eval.engine) if e is not None]
        if any(e.type != "torch" or e.serve != "embedded" or e.urls for e in engines):
            raise KeyConflict(
                "trainer.lora.publish adapters: only the embedded torch engine merges "
                "adapter versions onto its base weights; SGLang servers and engine actors "
                "take merged versions: set --lora-publish merged",
                ("trainer", "lora", "publish"),
            )
        base = os.path.realpath(self.trainer.model_path) if self.trainer else ""
        other = [e.model_path for e in engines if e.model_path]
        if any(os.path.realpath(p) != base for p in other):
            raise KeyConflict(
                f"trainer.lora.publish adapters: the engines merge adapters onto the model "
                f"they load ({other[0]}), which must be the trainer's base "
                f"({self.trainer.model_path if self.trainer else None}); drop the engine's "
                "model_path or set --lora-publish merged",
                ("trainer", "lora", "publish"),
            )
        return self

    @model_validator(mode="after")
    def _trained_reward_exists(self) -> RunConfig:
        terms = [t.name for t in self.rollout.reward.terms]
        key = self.trainer.reward_key if self.trainer is not None else "score"
        if terms and key not in ("score", *terms):
            raise KeyConflict(
                f"trainer.reward_key {key!r} is not among the reward's keys (score, "
                f"{', '.join(terms)}): every group would be untrainable",
                ("trainer", "reward_key"),
            )
        return self

    @model_validator(mode="after")
    def _mini_batches_hold_whole_groups(self) -> RunConfig:
        size = self.trainer.global_batch_size if self.trainer is not None else None
        n, groups = self.buffer.num_samples_per_prompt, self.buffer.groups_per_step
        if size is None:
            return self
        if size % n or size > groups * n:
            raise KeyConflict(
                f"trainer.global_batch_size {size} must be a multiple of n_samples_per_prompt "
                f"({n}: a mini-batch holds whole groups, whose samples the advantages "
                f"compare) and at most the rollout batch ({groups} groups x {n} = "
                f"{groups * n} samples)",
                ("trainer", "global_batch_size"),
            )
        return self

    @model_validator(mode="after")
    def _groups_to_compare(self) -> RunConfig:
        """A group-relative advantage of a group of one is ``r - mean(r) = 0``: every
        sample would train with zero loss, silently."""
        estimator = self.algo.advantage_estimator
        group_relative = (
            "grpo",
            "dr_grpo",
            "rloo",
            "gspo",
            "cispo",
            "reinforce_pp_baseline",
        )
        trains = not self.train.debug_rollout_only
        if trains and estimator in group_relative and self.buffer.num_samples_per_prompt < 2:
            raise KeyConflict(
                f"{estimator}'s advantages compare the samples of a prompt's group: with "
                "one sample per prompt each is 0 and nothing is learned; set "
                "--n-samples-per-prompt 2 or more, or use reinforce_pp or ppo",
                ("buffer", "num_samples_per_prompt"),
            )
        return self

    @model_validator(mode="after")
    def _async_needs_a_correction(self) -> RunConfig:
        if not self.train.debug_rollout_only:  # nothing is trained in rollout-only mode
            self.algo.check_async(self.buffer.max_staleness)
        if self.rollout.colocate and self.buffer.max_staleness > 0:
            raise ValueError(
                f"rollout.colocate with max_staleness={self.buffer.max_staleness}: colocated "
                "engines sleep while the trainer steps, so generation cannot run ahead of "
                "training; set --buffer.max-staleness 0 (synchronous) or drop --colocate"
            )
        if self.rollout.tool_use is not None and self.data and not self.data.apply_chat_template:
            raise ValueError(
                "rollout.tool_use needs data.apply_chat_template: the tools' schemas and the "
                "tool messages reach the model through the tokenizer's chat template"
            )
        if self.rollout.agent is not None and (self.rollout.tool_use or self.rollout.workflow):
            raise ValueError(
                "rollout.agent is the workflow, and the agent runs its own tools: drop "
                "rollout.tool_use and rollout.workflow (or drop rollout.agent)"
            )
        if self.train.debug_rollout_only and self.eval.enabled:
            raise ValueError(
                "eval.interval is set but debug_rollout_only never changes the weights: "
                "there is nothing new to evaluate"
            )
        self._engine_actors_fit()
        if not is_loopback(self.runtime.host) and self.wire.curve_keys is None:
            raise ValueError(
                f"runtime.host {self.runtime.host!r} is not loopback: channels bind beyond "
                "this host only encrypted; make keys with `asyncrl keys DIR` and set "
                "--wire.curve-keys DIR"
            )
        if self.train.publish == "dist" and not is_loopback(self.runtime.host):
            check_group_host(f"{self.runtime.host}:0", trusted=self.train.dist_trusted_network)
        return self

    def _one_rank_per_rollout_actor(self, engine: EngineConfig) -> None:
        """dist: each rollout actor's engines are one rank of the weight group (rollout-i
        is rank i + 1), so one server with one TP rank (``rollout/server_group.py``)."""
        flag = "--update-weight-transport dist"
        if engine.router:
            raise ValueError(
                f"{flag} broadcasts to each server, not through a router: list the servers "
                "in urls, or use --update-weight-transport disk"
            )
        if engine.urls and (len(engine.urls) > 1 or self.rollout.num_actors > 1):
            raise ValueError(
                f"{flag} gives each rollout actor one server: {len(engine.urls)} urls for "
                f"{self.rollout.num_actors} rollout actor(s); use --rollout-engine-serve actor "
                "(a server per rollout actor) or --update-weight-transport disk"
            )
        remote = [u for u in engine.urls if not is_loopback(urlsplit(u).hostname or "")]
        if remote:
            raise ValueError(
                f"{flag} into {remote[0]}: a version the group cannot carry (while it forms, "
                "after a failed broadcast) goes to the server through a local folder, which a "
                "server on another host cannot read; use --update-weight-transport disk with "
                "a shared folder, or a server on this host"
            )
        tp = _server_tp(engine.server_args)
        if tp > 1:
            raise ValueError(
                f"{flag} into a server with {tp} tensor-parallel ranks is not supported yet "
                "(one rank per rollout actor): use --update-weight-transport disk"
            )

    def _vllm_has_one_client(self) -> None:
        """A vLLM server takes one client: its pause and weight-update session are the
        server's, so two rollout actors (or an eval engine) at the same url would
        interleave them."""
        engine, other = self.rollout.engine, self.eval.engine
        if engine is None or engine.type != "vllm" or engine.serve != "embedded":
            return
        if self.rollout.num_actors > 1:
            raise ValueError(
                f"rollout.engine.type vllm at urls: a vLLM server takes one client, and "
                f"{self.rollout.num_actors} rollout actors would share it; use "
                "--rollout.engine.serve actor (a vLLM per rollout actor) or one rollout actor"
            )
        if other is not None and other.type == "vllm" and set(other.urls) & set(engine.urls):
            raise ValueError("eval.engine and rollout.engine name the same vLLM server")
        if self.eval.enabled and other is None and not engine.model_path:
            raise ValueError(
                "eval beside vLLM at urls runs its own engine: set rollout.engine.model_path "
                "(the eval actor embeds the torch engine of that model) or eval.engine"
            )

    def _engine_actors_fit(self) -> None:
        self._vllm_has_one_client()
        if self.eval.engine is not None and self.eval.engine.serve == "actor":
            raise ValueError(
                "eval.engine.serve: actor is not supported; the eval actor embeds its engine"
            )
        engine = self.rollout.engine
        if self.train.publish == "dist" and engine is not None:
            self._one_rank_per_rollout_actor(engine)
        if engine is None or engine.serve != "actor":
            return
        if self.train.publish == "pull":
            raise ValueError(
                "rollout.engine.serve: actor serves the engines over HTTP, which take new "
                "weights from disk or by broadcast: set --update-weight-transport disk or dist"
            )
        if self.rollout.colocate:
            raise ValueError("rollout.engine.serve: actor cannot be colocated (yet)")
        if self.eval.enabled and self.eval.engine is None and engine.type == "sglang":
            raise ValueError(
                "eval with launched sglang engines needs its own eval.engine (e.g. the urls "
                "of a server, or an embedded torch engine)"
            )

    def resolved_output_dir(self) -> Path:
        """``output_dir`` with ``{name}`` filled in and ``~`` expanded."""
        return Path(self.output_dir.replace("{name}", self.name)).expanduser()


def debug_cpu() -> RunConfig:
    """A tiny CPU dry run: two rollout actors, fast heartbeats, quick stops."""
    return RunConfig(
        name="debug-cpu",
        runtime=RuntimeConfig(heartbeat_interval=0.5, stop_timeout=5.0),
        rollout=RolloutConfig(num_actors=2),
    )


PRESETS: dict[str, Callable[[], BaseModel]] = {"debug_cpu": debug_cpu}
