"""Shared pytest set-up: every async test runs on uvloop, as the actors do."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    """Run async tests on uvloop (the event loop every asyncrl actor uses)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def endpoint() -> str:
    """A loopback tcp endpoint that lets the binding socket pick a free port."""
    return "tcp://127.0.0.1:0"
