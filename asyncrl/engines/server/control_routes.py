"""The control-plane routes of the embedded server (``docs/sglang_api.md`` section 2).

``ControlRoutes`` answers every call besides generation: abort and pause, weight updates
and the weight version, cache and memory, health, model and server info, loads. Admin
calls answer ``{"success", "message"}``, with 400 when ``success`` is false. A
``weight_version`` may be any string, as SGLang's: a number is the version, any other
string names the next one (``generate_wire.parse_version``) and is what is reported.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncrl.engines.base import GroupEngine
from asyncrl.engines.server.generate_wire import (
    ApiError,
    Json,
    field,
    invalid_body,
    json_response,
    openai_error,
    parse_version,
    read_json,
    version_text,
)
from asyncrl.observe.logs import get_logger

if TYPE_CHECKING:
    from asyncrl.engines.server.app import EngineServer

log = get_logger("asyncrl.server")

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


#: Version names kept for ``weight_versions`` spans of requests still running.
_NAMES_KEPT = 64


class ControlRoutes:
    """Section 2's routes over one ``EngineServer`` (its engine and traffic gate)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = server.engine
        self.gate = server.gate

    def register(self, router: web.UrlDispatcher) -> None:
        """Add every control route to ``router``."""
        posts = {
            "/abort_request": self.abort_request,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
            "/update_weight_version": self.update_weight_version,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
        }
        for path, handler in posts.items():
            router.add_post(path, handler)
        both = {
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": self.release_memory,
            "/resume_memory_occupation": self.resume_memory,
        }
        for path, handler in both.items():
            router.add_get(path, handler)
            router.add_post(path, handler)
        gets = {
            "/health": self.health,
            "/health_generate": self.health_generate,
            "/ready": self.ready_route,
            "/get_weight_version": self.weight_version,
            "/weight_version": self.weight_version,
            "/get_model_info": self.model_info,
            "/model_info": self.model_info,
            "/get_server_info": self.server_info,
            "/server_info": self.server_info,
            "/v1/models": self.models,
            "/v1/loads": self.loads,
            "/get_load": self.get_load,
            "/version": self.version,
        }
        for path, handler in gets.items():
            router.add_get(path, handler)
        router.add_get("/v1/models/{model:.+}", self.model)
        router.add_get("/ping", self.health)  # SGLang's SageMaker health route
        router.add_post("/ping", self.health)

    # -- abort, pause -------------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request``: a live rid (and the ids it begins), or all, as SGLang's;
        empty 200 before the outputs exist (2.9)."""
        body = await read_json(request)
        rid = field(body, "rid", str, "")
        self.engine.abort(rid, abort_all=field(body, "abort_all", bool, False))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``/pause_generation`` (2.8): abort mode returns once every call is answered."""
        mode = field(await read_json(request), "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise invalid_body(f"mode: expected 'abort', 'retract' or 'in_place', got {mode!r}")
        self.gate.open.clear()
        # Calls that passed the gate start their items this tick; let them reach the engine
        # so the pause sees (and, in abort mode, aborts) them.
        await asyncio.sleep(0)
        await self.engine.pause(mode)
        if mode == "abort":
            await self.gate.drained()
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``/continue_generation`` (2.8)."""
        await read_json(request)
        await self.engine.resume()
        self.gate.open.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    # -- weights ------------------------------------------------------------------------------
    def _group_engine(self) -> GroupEngine:
        """The engine, if it joins weight groups; a 400 (through ``_admin``) otherwise."""
        if not isinstance(self.engine, GroupEngine):
            raise ValueError(f"{type(self.engine).__name__} does not join weight groups")
        return self.engine

    async def _admin(self, request: web.Request, action: Callable[[Json], Awaitable[Json]]) -> Any:
        """Run an admin action: ``{"success": true, ...}`` or 400 ``{"success": false}`` (2)."""
        body = await read_json(request)
        try:
            reply = await action(body)
        except ApiError as exc:
            return json_response({"success": False, "message": exc.message}, status=400)
        except ValueError as exc:  # EngineError or a bad parameter: the caller's to fix
            log.warning("admin call refused", path=request.path, error=str(exc))
            return json_response({"success": False, "message": str(exc)}, status=400)
        except Exception as exc:  # a failed load or collective: SGLang answers 400, not 500
            log.exception("admin call failed", path=request.path)
            return json_response({"success": False, "message": f"{exc!r}"}, status=400)
        return json_response({"success": True, **reply})

    def _name(self, body: Json, name: str | None) -> None:
        """After an update that gave ``weight_version``: the engine's version name (None
        for a number); an update without one leaves the name as it was, as SGLang's."""
        if body.get("weight_version") is not None:
            self._set_name(name)

    def _set_name(self, name: str | None) -> None:
        names = self.engine.version_names
        names.pop(self.engine.version, None)
        if name is not None:
            names[self.engine.version] = name
            while len(names) > _NAMES_KEPT:  # the oldest go: tokens that old are long done
                names.pop(min(names))

    def _abort_first(self, body: Json, default: bool = False) -> None:
        if field(body, "abort_all_requests", bool, default):
            self.engine.abort(abort_all=True)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk`` (2.1)."""

        async def action(body: Json) -> Json:
            path = field(body, "model_path", str)
            if not path:
                raise ValueError("model_path is required")
            version, name = parse_version(body.get("weight_version"), self.engine.version)
            self._abort_first(body)
            async with self.gate.updating():
                await self.engine.update_weights_from_disk(path, version)
            self._name(body, name)
            return {
                "message": _updated("model weights", version_text(self.engine)),
                "num_paused_requests": 0,
            }

        return await self._admin(request, action)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group`` (2.2): rank = rank_offset (one TP rank here)."""

        async def action(body: Json) -> Json:
            default_backend = "nccl" if self.engine.device.type == "cuda" else "gloo"
            await self._group_engine().init_weights_update_group(
                master_address=field(body, "master_address", str, "127.0.0.1"),
                master_port=_required(body, "master_port", int),
                rank=field(body, "rank_offset", int, 1),
                world_size=_required(body, "world_size", int),
                group_name=field(body, "group_name", str, "weight_update_group"),
                backend=field(body, "backend", str, default_backend),
            )
            return {"message": "Succeeded to initialize custom process group."}

        return await self._admin(request, action)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed`` (2.3): receive by broadcast (per tensor, or
        one ``flattened_bucket`` of their bytes), then load."""

        async def action(body: Json) -> Json:
            load_format = body.get("load_format")
            if load_format not in (None, "direct", "flattened_bucket"):
                raise ValueError(f"load_format {load_format!r} is not supported")
            version, name = parse_version(body.get("weight_version"), self.engine.version)
            self._abort_first(body)
            async with self.gate.updating():
                await self._group_engine().update_weights_from_distributed(
                    names=_required(body, "names", list),
                    dtypes=[d.removeprefix("torch.") for d in _required(body, "dtypes", list)],
                    shapes=_required(body, "shapes", list),
                    group_name=field(body, "group_name", str, "weight_update_group"),
                    version=version,
                    flattened=load_format == "flattened_bucket",
                )
            self._name(body, name)
            return {"message": _updated("parameter online", version_text(self.engine))}

        return await self._admin(request, action)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group`` (2.2)."""

        async def action(body: Json) -> Json:
            group = field(body, "group_name", str, "weight_update_group")
            await self._group_engine().destroy_weights_update_group(group)
            return {"message": "Succeeded to destroy custom process group."}

        return await self._admin(request, action)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """``/update_weights_from_tensor`` (2.4): tensors handed over by reference from a
        process on this host (shared memory, or CUDA IPC), decoded by an allow-list
        (``weights/payload.py``), then loaded."""

        async def action(body: Json) -> Json:
            from asyncrl.weights.payload import decode, named_tensors

            entries = _required(body, "serialized_named_tensors", list)
            if len(entries) != 1 or not isinstance(entries[0], str):
                raise ValueError(
                    f"serialized_named_tensors: one base64 string per TP rank; this server "
                    f"has 1 rank, got {len(entries)} entries"
                )
            load_format = body.get("load_format")
            if load_format not in (None, "direct", "flattened_bucket"):
                raise ValueError(f"load_format {load_format!r} is not supported")
            version, name = parse_version(body.get("weight_version"), self.engine.version)
            payload = await asyncio.to_thread(decode, entries[0])
            tensors = named_tensors(payload, load_format)
            self._abort_first(body)
            async with self.gate.updating():
                await self.engine.update_weights_from_tensors(tensors, version)
            self._name(body, name)
            return {"message": _updated("parameter online", version_text(self.engine))}

        return await self._admin(request, action)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version`` (2.6); ``abort_all_requests`` defaults to true."""

        async def action(body: Json) -> Json:
            version, name = parse_version(body.get("new_version"), self.engine.version)
            if version is None:
                raise ValueError("new_version is required")
            self._abort_first(body, default=True)
            self.engine.version = version
            self._set_name(name)
            text = version_text(self.engine)
            return {"message": f"Weight version updated to {text}", "new_version": text}

        return await self._admin(request, action)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """A no-op session opener (2.5): updates here need no session."""
        return await self._admin(request, _no_op("Weight update session begun."))

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """A no-op session closer (2.5)."""
        return await self._admin(request, _no_op("Weight update session ended."))

    # -- cache and memory ---------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache`` (2.10): text/plain, 400 while requests run or wait."""
        if await self.engine.flush_cache():
            return web.Response(text=_FLUSHED)
        load = self.engine.load()
        return web.Response(
            status=400,
            text=f"Cache not flushed: {load.num_running_reqs} running and "
            f"{load.num_waiting_reqs} waiting requests.\n",
        )

    async def release_memory(self, request: web.Request) -> web.Response:
        """``/release_memory_occupation`` (2.7): JSON null; needs an idle engine."""
        await self.engine.release_memory(_tags(await read_json(request)))
        return json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        """``/resume_memory_occupation`` (2.7): JSON null."""
        await self.engine.resume_memory(_tags(await read_json(request)))
        return json_response(None)

    # -- discovery ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """``/health``: 200 empty once warmed up, 503 while starting or stopping (2.11)."""
        return web.Response(status=200 if self.server.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """``/health_generate``: a real 1-token generation; 503 if none within 20 s."""
        if not self.server.alive:
            return web.Response(status=503)
        try:
            await self.server.probe()
        except Exception as exc:  # any failed generation is an unhealthy engine
            log.warning("health generation failed", error=repr(exc))
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready_route(self, request: web.Request) -> web.Response:
        """``/ready``: 200 when up and not paused (0.5.20+)."""
        return web.Response(status=200 if self.server.alive and not self.gate.paused else 503)

    async def weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version`` and ``/weight_version`` (2.6)."""
        return json_response({"weight_version": version_text(self.engine)})

    async def model_info(self, request: web.Request) -> web.Response:
        """``/get_model_info`` and ``/model_info`` (2.12)."""
        config = self.engine.model.config
        return json_response(
            {
                "model_path": self.engine.model_path,
                "tokenizer_path": self.engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": version_text(self.engine),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
                "served_model_name": self.server.served_model_name,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """``/get_server_info`` and ``/server_info`` (2.13): SGLang's resolved server args
        that have a meaning here, with the scheduler's and the server's own fields. The
        sglang-router reads ``model_path``, ``dp_size``, ``tp_size`` and ``version``;
        slime's external engines ``tp_size``, ``pp_size``, ``disaggregation_mode`` and
        ``encoder_only``; asyncrl's client ``context_length`` and ``tp_size``."""
        from asyncrl import __version__

        e = self.engine
        load = e.load()
        return json_response(
            {
                **_ENGINE_DEFAULTS,
                "dtype": str(getattr(e, "dtype", "auto")).removeprefix("torch."),
                **self.server.server_args,
                "model_path": e.model_path,
                "tokenizer_path": e.model_path,
                "served_model_name": self.server.served_model_name,
                "context_length": e.context_length,
                "max_context_length": e.context_length,
                "incremental_streaming_output": False,  # each chunk holds all text so far
                "max_running_requests": e.max_running,
                "max_total_tokens": e.max_total_tokens,
                "max_total_num_tokens": e.max_total_tokens,
                "max_req_input_len": e.context_length - 1,
                "tp_size": getattr(e, "tp_size", 1),  # a vLLM server's ranks (dist refuses >1)
                "weight_version": version_text(e),
                "device": e.device.type,
                "internal_states": [
                    {"dp_rank": 0, "paused": load.paused, "num_running_reqs": load.num_running_reqs}
                ],
                "startup_time": self.server.started,
                "launch_command": shlex.join(_redacted(sys.argv)),
                "version": __version__,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        """``/v1/models`` (2.14)."""
        return json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``/v1/models/{model}``: the served model's card, else OpenAI's 404."""
        wanted = request.match_info["model"]
        if wanted != self.server.served_model_name:
            message = f"The model '{wanted}' does not exist."
            return json_response(openai_error(message, 404, "NotFoundError"), 404)
        return json_response(self._card())

    def _card(self) -> Json:
        name = self.server.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(self.server.started),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.context_length,
        }

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` (2.14): the core fields for the one data-parallel rank."""
        from asyncrl import __version__

        load = self.engine.load()
        usage = load.num_used_tokens / max(load.max_total_num_tokens, 1)
        row = {
            "dp_rank": 0,
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_used_tokens": load.num_used_tokens,
            "max_total_num_tokens": load.max_total_num_tokens,
            "token_usage": usage,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": usage,
        }
        device = self.engine.device.type
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": __version__,
                "accelerator": None if device == "cpu" else device,
                "num_accelerators": 0 if device == "cpu" else 1,
                "loads": [row],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load`` (deprecated, polled by sglang-router 0.3.2)."""
        load = self.engine.load()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
                    "num_waiting_reqs": load.num_waiting_reqs,
                    "num_tokens": load.num_used_tokens,
                }
            ]
        )

    async def version(self, request: web.Request) -> web.Response:
        """``/version``."""
        from asyncrl import __version__

        return json_response({"version": __version__})


#: SGLang's server args whose value here is fixed: one rank of one replica, no paged or
#: quantized KV cache, no disaggregation, no LoRA slots (asyncrl merges adapters).
_ENGINE_DEFAULTS: Json = {
    "tp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "ep_size": 1,
    "page_size": 1,
    "kv_cache_dtype": "auto",
    "quantization": None,
    "load_format": "auto",
    "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "trust_remote_code": False,
    "is_embedding": False,
    "enable_lora": False,
    "disaggregation_mode": "null",
    "encoder_only": False,
    "stream_interval": 1,
    "kv_events": None,
}


def _redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` hidden (SGLang redacts its secrets too)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def _required(body: Json, key: str, kind: type) -> Any:
    value = field(body, key, kind)
    if value is None:
        raise ValueError(f"{key} is required")
    return value


def _tags(body: Json) -> list[str] | None:
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise invalid_body(f"tags: expected a list of strings or null, got {tags!r}")
    return tags


def _updated(what: str, version: str) -> str:
    return f"Succeeded to update {what}. Weight version updated to {version}."


def _no_op(message: str) -> Callable[[Json], Awaitable[Json]]:
    async def action(body: Json) -> Json:
        return {"message": message}

    return action
