"""How asyncrl starts a vLLM server: its interpreter, command line and environment.

vLLM's dependencies conflict with asyncrl's (its own transformers range and torch pin),
so it runs from its own virtualenv (``make vllm-venv`` builds ``.venv-vllm``). The server
needs asyncrl's worker extension (``ext.py``) and nothing else of asyncrl: its
``PYTHONPATH`` gets a directory holding only a link to the ``asyncrl`` package, so none of
asyncrl's own dependencies shadow vLLM's.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import asyncrl

#: Arguments asyncrl sets on every server it starts (``VLLMEngine`` checks them).
ASYNCRL_ARGS = (
    "--enable-scale-out",  # /inference/v1/generate: token ids in and out
    "--logprobs-mode", "processed_logprobs",  # log_softmax(z / T): engines/vllm/engine.py
    "--weight-transfer-config", '{"backend": "asyncrl"}',
    "--worker-extension-cls", "asyncrl.engines.vllm.ext.WorkerExtension",
)  # fmt: skip
#: Arguments the launcher assigns (``--model``, its endpoint) or that asyncrl needs.
ASSIGNED = (
    "--model",
    "--host",
    "--port",
    "--api-key",  # the engine actor's server holds the job's key; vLLM sits on loopback
    *(a for a in ASYNCRL_ARGS if a.startswith("--")),
)


def vllm_python(configured: str | None = None) -> str:
    """vLLM's interpreter: ``configured`` (which must be one), else
    ``$ASYNCRL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working directory or
    asyncrl's checkout. ``FileNotFoundError`` when there is none."""
    if configured:
        if os.access(configured, os.X_OK) and os.path.isfile(configured):
            return configured
        raise FileNotFoundError(f"vllm_python: {configured} is not an executable file")
    candidates = [os.environ.get("ASYNCRL_VLLM_PYTHON")]
    candidates += [str(root / ".venv-vllm" / "bin" / "python") for root in _roots()]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "no interpreter with vLLM: build it with `make vllm-venv` (.venv-vllm), or name "
        "one with rollout.engine.vllm_python or ASYNCRL_VLLM_PYTHON"
    )


def _roots() -> list[Path]:
    return [Path.cwd(), Path(asyncrl.__file__).resolve().parent.parent]


def vllm_command(
    python: str,
    model: str,
    host: str,
    port: int,
    *,
    dtype: str = "float32",
    seed: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """vLLM's OpenAI server with asyncrl's arguments, ``extra`` last. ``--seed`` comes from
    ``seed`` (``rollout/engines.py::engine_seed``) unless ``extra`` sets one."""
    named = any(a.split("=")[0] == "--seed" for a in extra)
    seeded = [] if seed is None or named else ["--seed", str(zlib.crc32(seed.encode()))]
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
        *ASYNCRL_ARGS, *seeded, *extra,
    ]  # fmt: skip


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: vLLM's development routes on, asyncrl's package (alone)
    on the path, usage reports off."""
    env = dict(os.environ if base is None else base)
    path = [str(package_link()), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        PYTHONPATH=os.pathsep.join(path),
    )
    return env


def package_link() -> Path:
    """A directory whose only entry links to the ``asyncrl`` package (made once, by an
    atomic rename, so concurrent launches agree)."""
    package = Path(asyncrl.__file__).resolve().parent
    digest = zlib.crc32(str(package).encode())
    root = Path(tempfile.gettempdir()) / f"asyncrl-vllm-path-{os.getuid()}-{digest:08x}"
    link = root / "asyncrl"
    if link.is_symlink() and link.resolve() == package:
        return root
    root.mkdir(parents=True, exist_ok=True)
    fresh = root / f".asyncrl-{os.getpid()}"
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(package, target_is_directory=True)
    os.replace(fresh, link)
    return root


def check_extra(args: list[str]) -> None:
    """Refuse ``server_args`` that would undo what asyncrl needs."""
    taken = [a for a in args if a.split("=")[0].replace("_", "-") in ASSIGNED]
    if taken:
        raise ValueError(f"vLLM server_args {taken}: asyncrl sets these itself")
