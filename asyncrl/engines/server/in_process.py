"""``InProcessGenerator``: the ``Generator`` of engines in this process, no HTTP.

An embedded engine (torch, sim) runs behind an ``EngineServer`` in the rollout actor's
process, so its workflows' non-stream ``/generate`` calls go straight to the server's
``generate_local`` (the same parsing, refusals, traffic gate and reply as its HTTP route)
and the reply is parsed as ``SGLangClient`` does. Streams and control calls still go over
HTTP. The servers live and die with this process: no retry, no rotation to leave.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.server.app import ServerClosed, ServerGone
from asyncrl.engines.sglang_wire import (
    EngineUnavailable,
    GenerateResult,
    SGLangError,
    error_message,
    generate_body,
    parse_generate_output,
)

if TYPE_CHECKING:
    from asyncrl.engines.server.app import EngineServer


class InProcessGenerator:
    """``generate`` on engine servers of this process (see the module docstring)."""

    def __init__(self, servers: Sequence[EngineServer], *, timeout_s: float = 4 * 3600.0) -> None:
        if not servers:
            raise ValueError("InProcessGenerator needs at least one engine server")
        self.servers, self.timeout_s = list(servers), timeout_s
        self._open = [0] * len(self.servers)
        self._cursor = 0

    def inflight(self) -> dict[str, int]:
        """Open calls per server URL."""
        urls = [s.url or f"server-{i}" for i, s in enumerate(self.servers)]
        return dict(zip(urls, self._open, strict=True))

    def _pick(self) -> int:
        n = len(self.servers)
        start, self._cursor = self._cursor % n, self._cursor + 1
        order = [(start + i) % n for i in range(n)]
        return min(order, key=self._open.__getitem__)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """``SGLangClient.generate``'s contract (non-stream): the final result, an abort
        being a normal partial one; ``SGLangError`` with the server's status and message
        for a refused request. The engine is the one with the fewest open calls, ties in
        rotation. A stopped server, or one whose engine stopped mid-call, raises
        ``EngineUnavailable``; a call past ``timeout_s``, ``TimeoutError``."""
        rid = rid or uuid.uuid4().hex
        typed = isinstance(sampling_params, SamplingParams)
        if typed and sampling_params.n != 1:
            raise ValueError(f"sampling_params.n is {sampling_params.n}; send n requests")
        body = generate_body(
            input_ids,
            None if typed else sampling_params,
            rid,
            return_logprob=return_logprob,
            extra=extra,
        )
        if typed:  # to the engine as they are: no dict built per call, none parsed again
            body["sampling_params"] = sampling_params
        index = self._pick()
        server, url = self.servers[index], self.servers[index].url or ""
        self._open[index] += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                status, payload = await server.generate_local(body)
        except ServerClosed as exc:
            raise EngineUnavailable(0, str(exc), url=url) from exc
        except ServerGone as exc:  # accepted, then lost: the call is not made again
            raise EngineUnavailable(0, f"/generate lost: {exc}", url=url) from exc
        finally:
            self._open[index] -= 1
        if status != 200 or not isinstance(payload, dict) or "error" in payload:
            raise SGLangError(status, error_message(payload), payload, url=url)
        return parse_generate_output(payload, engine=url)
