"""``asyncrl serve``: the embedded torch engine behind SGLang's HTTP API. Its engine
flags are ``EngineConfig``'s fields under SGLang's names."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over SGLang's HTTP API",
        description="Serve a Hugging Face model directory with the embedded torch engine behind "
        "an SGLang-compatible HTTP API (/generate, weight updates, OpenAI routes).",
    )
    serve.add_argument("--model", required=True, help="Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    serve.add_argument("--port", type=_port, default=30000, help="port (0: pick a free one)")
    _add_engine_flags(serve)
    serve.add_argument(
        "--weight-version", type=int, default=0, help="initial weight version (optimizer steps)"
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="parse /v1/chat/completions replies into tool_calls: hermes or qwen25 (the "
        "<tool_call> JSON format), llama3 (Llama 3.x JSON calls after <|python_tag|>), or "
        "module:Class (as SGLang's --tool-call-parser)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ASYNCRL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (as SGLang's "
        "--api-key; default: $ASYNCRL_API_KEY); needed to listen beyond loopback",
    )
    serve.add_argument(
        "--max-body-mb",
        type=_positive_float,
        default=8.0,
        help="refuse (413) a /generate or /v1 request body over this many MB before reading "
        "it all; a prompt past the model's context is refused before it is tokenized",
    )


#: ``asyncrl serve``'s engine flags: ``EngineConfig`` fields (``rollout.engine``'s keys)
#: under SGLang's ``launch_server`` names first, then their own.
SERVE_ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "device": ("--device",),
    "dtype": ("--dtype",),
    "max_running": ("--max-running-requests", "--max-running"),
    "max_total_tokens": ("--max-total-tokens",),
    "mem_fraction": ("--mem-fraction-static", "--mem-fraction"),
    "packed_weights": ("--packed-weights",),
    "lean_forward": ("--lean-forward",),
    "json_any_whitespace": ("--json-any-whitespace",),
    "cuda_graph": ("--cuda-graph",),
    "prompt_cache_tokens": ("--prompt-cache-tokens",),
    "seed": ("--random-seed", "--seed"),
}


#: SGLang's store-false switches for boolean engine fields.
_SGLANG_SWITCHES = {
    "--disable-cuda-graph": "cuda_graph",
    "--constrained-json-disable-any-whitespace": "json_any_whitespace",
}


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """One flag per ``SERVE_ENGINE_FLAGS`` field, typed, checked and described by it."""
    from asyncrl.config import metavar
    from asyncrl.engines.config import EngineConfig

    for name, flags in SERVE_ENGINE_FLAGS.items():
        field = EngineConfig.model_fields[name]
        note = " (serve: null draws it from the OS)" if name == "seed" else ""
        text = f"{field.description}{note} (default: {field.default})"
        serve.add_argument(
            *flags,
            dest=name,
            type=_field_value(field),
            default=field.default,
            help=text,
            metavar=metavar(field.annotation),
        )
    for name in ("packed_weights", "lean_forward"):  # the switches of earlier releases
        flag = "--no-" + name.replace("_", "-")
        serve.add_argument(flag, dest=name, action="store_false", help=argparse.SUPPRESS)
    for flag, dest in _SGLANG_SWITCHES.items():
        serve.add_argument(
            flag, dest=dest, action="store_false", help=f"as --{dest.replace('_', '-')} false"
        )
    serve.add_argument(
        "--disable-radix-cache",
        dest="prompt_cache_tokens",
        action="store_const",
        const=0,
        help="as --prompt-cache-tokens 0 (SGLang's name)",
    )


def _field_value(field: Any) -> Callable[[str], Any]:
    """A flag's text as ``field``'s value, or argparse's error with pydantic's reason."""
    import types
    from typing import Annotated, get_args

    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(Annotated[field.annotation, field])
    nullable = types.NoneType in get_args(field.annotation)

    def parse(raw: str) -> Any:
        if nullable and raw.lower() in ("null", "none"):
            return None
        try:
            return adapter.validate_python(raw)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise argparse.ArgumentTypeError(f"{reason}, got {raw}") from None

    return parse


def serve(args: argparse.Namespace) -> int:
    import ipaddress

    host = "127.0.0.1" if args.host == "localhost" else args.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not args.api_key:
        # The API can load weights from any path and abort anyone's work: no open access.
        print(
            f"asyncrl serve: refusing to listen on {args.host} without --api-key: the API "
            "can load weights from any path and abort any work",
            file=sys.stderr,
        )
        return 2
    if not Path(args.model).is_dir():
        print(f"asyncrl serve: --model {args.model} is not a model directory", file=sys.stderr)
        return 2
    import uvloop

    from asyncrl.engines.config import EngineConfig
    from asyncrl.engines.server.app import EngineServer, serve_until_signalled
    from asyncrl.engines.torch.engine import TorchEngine
    from asyncrl.observe.logs import configure_logging

    configure_logging(actor="serve")
    fields = {name: getattr(args, name) for name in SERVE_ENGINE_FLAGS}
    cfg = EngineConfig(type="torch", model_path=args.model, **fields)
    engine = TorchEngine.from_config(cfg, seed=cfg.seed, version=args.weight_version)
    server_args = {
        "host": host,
        "port": args.port,
        "dtype": cfg.dtype,  # auto resolved
        "tool_call_parser": args.tool_call_parser,
    }
    parser = None
    if args.tool_call_parser:
        from asyncrl.rollout.workflows import tool_call_parser

        parser = tool_call_parser(args.tool_call_parser)
    limit = int(args.max_body_mb * 2**20)
    server = EngineServer(
        engine,
        server_args=server_args,
        api_key=args.api_key,
        tool_call_parser=parser,
        max_body_bytes=limit,
    )
    uvloop.run(serve_until_signalled(server, host, args.port))
    return 0


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {raw}")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {raw}")
    return value
