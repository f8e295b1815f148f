"""Shared pytest set-up: offline transformers, every async test runs on uvloop, and the
tests that run whole jobs share one xdist worker.

``make test`` runs two pytest-xdist workers (``-n 2 --dist loadgroup``). The modules in
``JOB_MODULES`` start several processes each (actors, ranks, a Ray cluster, the real
model) and keep a 2-core machine busy on their own: they run one after another on one
worker, in the group ``jobs``, while the other worker takes the single-process tests.
Two jobs at once would starve each other's heartbeats.
"""

from __future__ import annotations

import os

# No model hub is reachable: transformers must never try (set before anything imports it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop

JOB_MODULES = frozenset({
    "test_actor.py", "test_bench_cli.py", "test_bench_overlap.py", "test_bench_vs_trl.py",
    "test_buffer_actor.py", "test_chaos.py", "test_cli.py", "test_controller_faults.py",
    "test_engine_actor.py", "test_engine_rotation.py", "test_examples.py", "test_export.py",
    "test_failing_jobs.py", "test_logprob_agreement.py", "test_megatron_bridge.py",
    "test_megatron_trainer.py", "test_preflight.py", "test_ray_runtime.py",
    "test_real_model.py", "test_router.py", "test_run_dir.py", "test_runtime.py",
    "test_security.py", "test_sft.py", "test_sim_job.py", "test_train.py",
    "test_trainer_actor.py", "test_trainer_ranks.py",
})  # fmt: skip


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    """The tests of ``JOB_MODULES`` in one xdist group (module docstring)."""
    for item in items:
        if item.path.name in JOB_MODULES:
            item.add_marker(pytest.mark.xdist_group("jobs"))


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    """Run async tests on uvloop (the event loop every asyncrl actor uses)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def endpoint() -> str:
    """A loopback tcp endpoint that lets the binding socket pick a free port."""
    return "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 (tests/tiny_model.py) saved with its tokenizer, per module."""
    from tests.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape from another seed: a reference model that differs from the policy."""
    from tests.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("ref")
    build_tiny_model(path, seed=1)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (asyncrl/model_zoo.py), built once per
    machine into the model cache: the real pretrained model of the real-model tests."""
    from asyncrl.model_zoo import smollm2_dir

    return smollm2_dir()
