"""Shared pytest set-up: offline transformers, and every async test runs on uvloop, bounded
in time."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os

# No model hub is reachable: transformers must never try (set before anything imports it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    """Run async tests on uvloop (the event loop every asyncrl actor uses)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """An async test runs under ``asyncio.timeout`` of its pytest-timeout limit (the
    marker's, else the ini's): that plugin's SIGALRM never interrupts uvloop, so a hung
    test held the whole suite. Timed out here, it fails alone, its traceback at the await
    that hung."""
    fn = getattr(item, "obj", None)
    limit = _timeout(item)
    if not inspect.iscoroutinefunction(fn) or not limit:
        return (yield)

    @functools.wraps(fn)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        async with asyncio.timeout(limit):
            return await fn(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(item, "obj", bounded)
        return (yield)


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


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
