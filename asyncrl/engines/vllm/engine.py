"""A vLLM server as an asyncrl engine: ``VLLMEngine`` speaks vLLM's own API.

``EngineServer(VLLMEngine(url))`` answers SGLang's routes, and ``VLLMEngine`` turns each
call into vLLM's (0.32, ``VLLM_SERVER_DEV_MODE=1``, ``--enable-scale-out``; ``launch.py``
starts such a server)::

    generate             POST /inference/v1/generate   token ids in and out, the sampled
                                                       token's log-prob, per-token
                                                       ``weight_versions`` spans
    abort                POST /abort_requests          by request id (vLLM prefixes ours
                                                       with ``generate-tokens-``); "all"
                                                       is every call of this engine
    pause / resume       POST /pause?mode=abort|keep, /resume
    weights              POST /start_weight_update, /update_weights,
                         /finish_weight_update {weight_version}: the ``asyncrl`` backend
                         (``engines/vllm/ext.py``) reads a directory or receives a
                         broadcast from the trainer's group
    weight group         POST /init_weight_transfer_engine, /shutdown_weight_transfer_engine
    cache, memory        POST /reset_prefix_cache, /sleep, /wake_up

The server reports ``--logprobs-mode processed_logprobs``; ``check`` refuses what would
make those differ from asyncrl's ``log_softmax(z / T)`` (``docs/numerics.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import torch

from asyncrl.engines.base import (
    ANY_JSON,
    EngineLoad,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_prompt,
    mark_aborted,
)
from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.vllm")

#: vLLM's /inference/v1/generate names a request ``generate-tokens-<our id>``; its abort
#: route takes that name.
RID_PREFIX = "generate-tokens-"
#: vLLM's name of the weights it started with.
INITIAL_LABEL = "default"
#: Seconds between abort calls for a request that is still running (an abort that
#: reached vLLM before the request did finds nothing).
ABORT_RETRY_S = 0.5
#: The longest a control call (pause, resume, abort, info) may take.
CONTROL_TIMEOUT_S = 120.0


class VLLMRefused(EngineError):
    """vLLM refused a call (4xx; the message is vLLM's): a 400 from our server too."""


class VLLMFailed(RuntimeError):
    """vLLM failed a call (5xx) or could not be reached."""


@dataclass(eq=False)
class _Call:
    rid: str
    aborted: bool = False
    finish: FinishReason | None = None
    updated: asyncio.Event = field(default_factory=asyncio.Event)


class VLLMEngine:
    """One vLLM server behind asyncrl's engine protocol (module docstring).

    ``start`` reads the server's model and context and checks its settings; ``run`` (the
    server's engine task) sends aborts and client-named versions; ``close`` ends the HTTP
    session. An update pauses vLLM with ``keep`` unless the caller paused already, loads,
    names the version (vLLM then reports which tokens each version sampled) and resumes:
    no step runs half-loaded weights or under the wrong name. One that fails leaves vLLM
    paused (``torn``) until a whole version loads. A server takes one client
    (``RunConfig`` refuses sharing): its pause and update session are the server's.
    """

    def __init__(
        self,
        url: str,
        *,
        model_path: str | None = None,
        api_key: str | None = None,
        update_timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_path = model_path or ""
        self.api_key = api_key
        self.update_timeout_s = update_timeout_s
        self._version = 0
        self._label: int | None = None  # a version named by a client, for ``run`` to send
        self.version_names: dict[int, str] = {}
        self.device = torch.device("cpu")
        self.context_length = 0
        self.max_running = 0  # vLLM's max_num_seqs
        self.max_total_tokens = 0  # its KV cache, in tokens
        self.tp_size = 1  # vLLM's world size: ranks it would need in a weight group
        self.tokenizer: Any = None
        self.model: Any = SimpleNamespace(config=SimpleNamespace())
        self.vocab_size = 0
        self.torn = False  # an update failed midway: vLLM stays paused
        self._served = ""  # the model name vLLM serves
        self._session: aiohttp.ClientSession | None = None
        self._live: dict[str, _Call] = {}
        self._aborting: dict[str, _Call] = {}
        self._wake = asyncio.Event()
        self._paused_by: str | None = None  # "caller" or "update" while vLLM is paused
        self._updating = False  # between start_weight_update and finish_weight_update
        self._session_open = False  # vLLM may hold a started, unfinished update session
        self._groups: set[str] = set()
        self._lock = asyncio.Lock()  # one weight call sequence at a time

    @property
    def version(self) -> int:
        """The version the engine serves (set by a weight update, or named by a client)."""
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        """A client named the version (``/update_weight_version``): vLLM's label follows
        from ``run``, so tokens sampled in between still carry the old one."""
        self._version, self._label = version, version
        self._wake.set()

    # -- lifetime -------------------------------------------------------------------------
    async def start(self) -> VLLMEngine:
        """Open the session; read the model, its context and the served version; take
        the server back from a predecessor that died mid-update (an open update session,
        vLLM left paused). The HTTP session is closed again if any of it fails."""
        try:
            return await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> VLLMEngine:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            # A connection per call, none kept: with kept ones, calls right after a weight
            # update failed ("Server disconnected", "Cannot write request body"), with none
            # kept none did. Calls are long: a fresh loopback connection costs nothing
            # beside them.
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )
        models = (await self._call("GET", "/v1/models"))["data"][0]
        self._served = models["id"]
        self.context_length = int(models["max_model_len"])
        self.model_path = self.model_path or models.get("root") or self._served
        await self._check_server()
        await self._take_over()
        self._version = self._version_of(await self._weight_label())
        await asyncio.to_thread(self._load_tokenizer)
        log.info(
            "vllm engine connected",
            url=self.url,
            model=self.model_path,
            context=self.context_length,
            version=self.version,
        )
        return self

    async def _check_server(self) -> None:
        """Refuse a server whose log-probs or weight backend asyncrl cannot use."""
        try:
            reply = await self._call("POST", "/collective_rpc", {"method": "asyncrl_settings"})
            settings = reply["results"][0]
        except (EngineError, VLLMFailed, KeyError, IndexError, TypeError) as exc:
            settings = {"error": str(exc)}
        wanted = {"logprobs_mode": "processed_logprobs", "weight_transfer": "asyncrl"}
        wrong = {k: settings.get(k) for k, v in wanted.items() if settings.get(k) != v}
        if wrong:
            raise EngineError(
                f"the vLLM server at {self.url} was not started for asyncrl ({wrong}, "
                f"{settings.get('error', '')}): start it with VLLM_SERVER_DEV_MODE=1 and "
                "asyncrl's arguments (engines/vllm/launch.py: --enable-scale-out, "
                "--logprobs-mode processed_logprobs, --weight-transfer-config "
                '\'{"backend": "asyncrl"}\', --worker-extension-cls '
                "asyncrl.engines.vllm.ext.WorkerExtension)"
            )
        self.device = torch.device(str(settings.get("device", "cpu")).split(":")[0])
        self.max_running = int(settings.get("max_num_seqs", 0))
        self.max_total_tokens = int(settings.get("kv_tokens", 0))
        self.tp_size = int(settings.get("world_size", 1))

    async def _take_over(self) -> None:
        """A predecessor of this engine (a restarted rollout actor) may have left vLLM
        mid-update or paused: end the session and resume, or every call would hang."""
        reply = await self._call("POST", "/collective_rpc", {"method": "asyncrl_abandon_update"})
        abandoned = any(reply.get("results") or [])
        paused = bool((await self._call("GET", "/is_paused")).get("is_paused"))
        if abandoned or paused:
            log.warning(
                "vllm was left mid-update or paused; resumed",
                url=self.url,
                abandoned_update=abandoned,
                paused=paused,
            )
            await self._call("POST", "/resume")

    def _load_tokenizer(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            config = AutoConfig.from_pretrained(self.model_path)
        except OSError as exc:
            raise EngineError(
                f"the vLLM server at {self.url} serves {self.model_path!r}, which is not a "
                "model folder here: set rollout.engine.model_path to a local copy (its "
                f"tokenizer and config): {exc}"
            ) from None
        self.model = SimpleNamespace(config=config)
        text = getattr(config, "get_text_config", lambda: config)()
        self.vocab_size = int(getattr(text, "vocab_size", 0) or len(self.tokenizer))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        """Send the aborts ``abort`` asked for, again while an aborted call still runs;
        runs until cancelled (the server's engine task)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._label is not None:
                label, self._label = str(self._label), None
                await self._quietly(
                    self._call("POST", "/update_weight_version", {"new_version": label})
                )
            calls = [c for c in self._aborting.values() if c.finish is None]
            self._aborting = {c.rid: c for c in calls}
            if calls:
                ids = [RID_PREFIX + c.rid for c in calls]
                await self._quietly(self._call("POST", "/abort_requests", {"request_ids": ids}))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), ABORT_RETRY_S)
                self._wake.set()

    # -- generation -----------------------------------------------------------------------
    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        if self.torn and not self._updating:  # vLLM stays paused: the call would hang
            raise EngineError("a weight update failed midway: load a whole version first")
        check_prompt(request, self.vocab_size, self.context_length, self._live)
        p = request.sampling
        if p.stop_regexes:
            raise EngineError("stop_regex is not supported by a vLLM engine")
        if request.token_ids_logprob is not None:
            raise EngineError("token_ids_logprob is not supported by a vLLM engine")
        if p.structural_tag is not None:  # SGLang's format is not vLLM's
            raise EngineError("structural_tag is not supported by a vLLM engine")
        if p.sampling_seed is not None and self.device.type == "cpu":
            # vLLM 0.32's CPU runner rewinds a seeded request's generator after a chunked
            # prefill step, which a CPU generator cannot do: the engine core dies, and
            # every request on the server with it.
            raise EngineError(
                "sampling_seed: vLLM's CPU build fails the whole server on a seeded request "
                "whose prompt is prefilled in chunks (CPU Generator does not use offset)"
            )
        if request.return_logprob and request.logprob_start_len >= 0:
            raise EngineError("prompt log-probs are not supported by a vLLM engine")
        truncated = p.top_k not in (-1, 0) or p.top_p < 1 or p.min_p > 0
        if truncated and not p.greedy and request.return_logprob:
            raise EngineError(
                "a vLLM engine reports log-probs of the truncated distribution, not "
                "asyncrl's log_softmax(z / T): sample with top_k -1, top_p 1 and min_p 0"
            )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """One call to vLLM; its output once it ends (aborted: the partial output)."""
        self.check(request)
        call = _Call(request.rid)
        self._live[request.rid] = call
        start = time.perf_counter()
        try:
            reply = await self._call(
                "POST", "/inference/v1/generate", _body(request), timeout_s=None
            )
            out = self._output(request, reply, call)
            out.e2e_latency = time.perf_counter() - start
            call.finish = out.finish_reason
            yield out
        finally:
            del self._live[request.rid]
            self._aborting.pop(request.rid, None)

    def _output(
        self, request: GenerateRequest, reply: dict[str, Any], call: _Call
    ) -> GenerateOutput:
        choice = reply["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        top = None
        if request.top_logprobs_num > 0:
            top = [
                [(float(t["logprob"]), int(t["token_id"])) for t in c["top_logprobs"]][
                    : request.top_logprobs_num
                ]
                for c in content
            ]
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return GenerateOutput(
            rid=request.rid,
            output_ids=ids,
            logprobs=logprobs,
            versions=list(self._versions(choice.get("weight_versions"), len(ids))),
            finish_reason=_finish(choice, ids, call),
            prompt_tokens=int(usage.get("prompt_tokens") or len(request.input_ids)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            top_logprobs=top,
            queued=call.aborted and not ids,
        )

    def _versions(self, spans: list[dict[str, Any]] | None, n: int) -> Iterator[int]:
        """The version of each of ``n`` tokens from vLLM's ``[start, end)`` spans."""
        covered = 0
        for span in spans or []:
            version = self._version_of(str(span["version"]))
            for _ in range(int(span["start"]), int(span["end"])):
                covered += 1
                yield version
        yield from [self.version] * (n - covered)

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort as ``TorchEngine.abort`` does; vLLM answers each call with its partial
        output (``run`` sends the aborts)."""
        count = mark_aborted(self._live, rid, abort_all, prefix=prefix)
        if count:
            self._aborting.update({r: c for r, c in self._live.items() if c.aborted})
            self._wake.set()
        return count

    def load(self) -> EngineLoad:
        """The calls this engine has open (vLLM's own queue is not read)."""
        return EngineLoad(
            num_running_reqs=len(self._live),
            num_waiting_reqs=0,
            num_used_tokens=0,
            max_total_num_tokens=self.max_total_tokens,
            paused=self._paused_by is not None,
        )

    # -- pause ----------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """``abort``: vLLM ends every request (partial outputs); ``in_place`` and
        ``retract``: requests stay, frozen (vLLM's ``keep``)."""
        await self._pause("abort" if mode == "abort" else "keep")
        self._paused_by = "caller"

    async def resume(self) -> None:
        """Continue after ``pause``; refused while an update left the weights torn."""
        if self.torn:
            raise EngineError("a weight update failed midway: load a whole version first")
        await self._call("POST", "/resume")
        self._paused_by = None

    async def _pause(self, mode: str) -> None:
        await self._call("POST", f"/pause?mode={mode}")

    # -- weights --------------------------------------------------------------------------
    async def update_weights_from_disk(self, path: str, version: int | None) -> None:
        """Load the safetensors directory ``path`` as ``version``."""
        async with self._lock:
            await self._begin()
            await self._send({"path": path}, self.update_timeout_s)
            await self._end(version)

    async def update_weights_from_tensors(
        self, tensors: dict[str, Any], version: int | None
    ) -> None:
        raise EngineError("a vLLM engine takes weights from disk or by broadcast")

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """vLLM's workers join the trainer's group (``vllm_ext.GroupTransfer``)."""
        info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank": rank,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._call(
            "POST",
            "/init_weight_transfer_engine",
            {"init_info": info},
            timeout_s=self.update_timeout_s,
        )
        self._groups.add(group_name)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | None,
        *,
        flattened: bool = False,
    ) -> None:
        """Receive one bucket by broadcast; the bucket that names ``version`` is the last
        of the update (SGLang's contract), which then ends."""
        if group_name not in self._groups:
            raise EngineError(f"no weights update group named {group_name!r}: init it first")
        bucket = {
            "group_name": group_name,
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "flattened": flattened,
        }
        async with self._lock:
            if not self._updating:
                await self._begin()
            await self._send(bucket, self.update_timeout_s)
            if version is not None:
                await self._end(version)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the trainer's group (vLLM's route leaves every group: there is one)."""
        if group_name not in self._groups:
            raise EngineError(f"The group to be destroyed does not exist: {group_name!r}")
        self._groups.clear()
        await self._call("POST", "/shutdown_weight_transfer_engine")

    async def _begin(self) -> None:
        paused_here = self._paused_by is None
        try:
            if paused_here:
                self._paused_by = "update"  # before the call: a cancelled pause may land
                await self._pause("keep")
            if self._session_open:  # an earlier finish failed, or its call was cut off
                await self._call("POST", "/collective_rpc", {"method": "asyncrl_abandon_update"})
            await self._call("POST", "/start_weight_update", timeout_s=self.update_timeout_s)
        except BaseException:
            if paused_here:  # nothing was loaded: serve the old weights again
                self._paused_by = None
                await self._quietly(self._call("POST", "/resume"))
            raise
        self._updating, self.torn, self._session_open = True, True, True

    async def _send(self, info: dict[str, Any], timeout_s: float) -> None:
        try:
            await self._call("POST", "/update_weights", {"update_info": info}, timeout_s=timeout_s)
        except BaseException:
            self._updating = False  # vLLM's worker ends the session on a failed chunk
            raise

    async def _end(self, version: int | None) -> None:
        label = {} if version is None else {"weight_version": str(version)}
        try:
            await self._call(
                "POST", "/finish_weight_update", label, timeout_s=self.update_timeout_s
            )
        finally:
            self._updating = False
        self.torn, self._session_open = False, False
        if version is not None:
            self._version = version
        if self._paused_by == "update":
            await self._call("POST", "/resume")
            self._paused_by = None

    # -- cache and memory -----------------------------------------------------------------
    async def flush_cache(self) -> bool:
        """vLLM's prefix cache; False while requests hold its blocks (as SGLang's)."""
        reply = await self._call("POST", "/reset_prefix_cache")
        return bool(reply.get("success", True)) if isinstance(reply, dict) else True

    async def release_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/sleep?level=1")

    async def resume_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/wake_up")

    # -- HTTP -----------------------------------------------------------------------------
    async def _weight_label(self) -> str:
        return str((await self._call("GET", "/weight_info"))["weight_version"])

    def _version_of(self, label: str) -> int:
        """asyncrl names vLLM's versions by their number; vLLM's first is ``default``."""
        if label.lstrip("-").isdigit():
            return int(label)
        return 0 if label == INITIAL_LABEL else self.version

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = CONTROL_TIMEOUT_S,
    ) -> Any:
        """One call to vLLM (``timeout_s`` None: no limit, for generation); vLLM's 4xx
        is ``VLLMRefused`` (a 400 from our server too), its 5xx ``VLLMFailed``."""
        if self._session is None:
            raise EngineError(f"the vLLM engine at {self.url} is not started")
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
        async with self._session.request(
            method, self.url + path, json=body, timeout=timeout
        ) as resp:
            text = await resp.text()
            if resp.status >= 500:
                raise VLLMFailed(f"vLLM {path}: {resp.status} {_message(text)}")
            if resp.status >= 400:
                raise VLLMRefused(f"vLLM {path}: {resp.status} {_message(text)}")
            if not text:
                return {}
            try:
                return await resp.json(content_type=None)
            except ValueError:
                return {"text": text}

    async def _quietly(self, call: Any) -> None:
        """A best-effort call: a failure is logged (the caller's outcome does not hang
        on it)."""
        try:
            await call
        except (aiohttp.ClientError, OSError, EngineError, VLLMFailed) as exc:
            log.warning("vllm call failed", url=self.url, error=str(exc))


def _body(request: GenerateRequest) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for ours (SGLang's sampling keys in vLLM's names)."""
    p = request.sampling
    params: dict[str, Any] = {
        # SGLang's greedy (temperature below 1e-6, or top_k 1) is vLLM's temperature 0:
        # vLLM samples top_k 1 at T > 0 and reports a log-prob of 0, not log_softmax(z).
        "temperature": 0.0 if p.greedy else p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 and not p.greedy else 0,
        "min_p": p.min_p,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty,
        "min_tokens": p.min_new_tokens,
        "ignore_eos": p.ignore_eos,
        "logprobs": max(request.top_logprobs_num, 0),
        "skip_special_tokens": p.skip_special_tokens,
        "spaces_between_special_tokens": p.spaces_between_special_tokens,
    }
    if p.max_new_tokens is not None:
        params["max_tokens"] = p.max_new_tokens
    if p.stop_strings:
        params["stop"] = p.stop_strings
        params["include_stop_str_in_output"] = True  # our server trims the text itself
    if p.stop_token_ids:
        params["stop_token_ids"] = list(p.stop_token_ids)
    if p.sampling_seed is not None:
        params["seed"] = p.sampling_seed
    if p.logit_bias:
        params["logit_bias"] = {int(k): v for k, v in p.logit_bias.items()}
    if (constraint := p.grammar) is not None:
        params["structured_outputs"] = _structured(*constraint)
    return {
        "request_id": request.rid,
        "token_ids": list(request.input_ids),
        "sampling_params": params,
        "output_mode": "tokens",
    }


def _structured(key: str, spec: str) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` for SGLang's constraint (vLLM reports log-probs of
    the masked logits too: its grammar bitmask is applied before its sampler)."""
    if key == "json_schema":
        return {"json_object": True} if spec == ANY_JSON else {"json": json.loads(spec)}
    return {"regex": spec} if key == "regex" else {"grammar": spec}


def _finish(choice: dict[str, Any], ids: list[int], call: _Call) -> FinishReason:
    """SGLang's finish reason of a vLLM choice: ``stop`` names the stop string or token
    (EOS: the last token), ``length`` the length, ``abort`` an abort."""
    reason = choice.get("finish_reason")
    if reason == "length":
        return FinishReason(type="length", length=len(ids))
    if reason == "abort" or call.aborted:
        return FinishReason(type="abort", message="Abort before prefill" if not ids else None)
    matched = choice.get("stop_reason")
    return FinishReason(
        type="stop", matched=matched if matched is not None else ids[-1] if ids else None
    )


def _message(text: str) -> str:
    """vLLM's error message from an error body (its shapes vary by route)."""
    import json

    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)[:500]
