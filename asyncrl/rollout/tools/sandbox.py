"""The Python execution tool: run a snippet in a subprocess with hard limits.

Each call starts a fresh ``python -I -S -B`` (no ``PYTHON*`` variables, no ``site``: the
job's virtual environment is not importable) in its own session and an empty temporary
folder, with a minimal environment. A fixed preamble sets the rlimits and the isolation
(``landlock.py``), then runs the snippet from stdin as ``__main__``. The observation is
what a terminal would show; a program that fails is a normal one, and only a sandbox that
cannot start raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rollout.tools import landlock
from asyncrl.rollout.tools.registry import FunctionTool


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Per-call limits: ``cpu_s`` (``RLIMIT_CPU``: ``SIGXCPU``, then a kill),
    ``memory_mb`` (``RLIMIT_AS``: allocations fail with ``MemoryError``), ``file_bytes``
    written and ``open_files`` (no core dumps); past ``wall_s`` or ``output_bytes`` per
    stream the parent kills the whole process group."""

    cpu_s: int = 5
    memory_mb: int = 512
    wall_s: float = 10.0
    output_bytes: int = 16_384
    file_bytes: int = 1 << 20
    open_files: int = 64

    def __post_init__(self) -> None:
        if min(self.cpu_s, self.memory_mb, self.output_bytes, self.open_files) < 1:
            raise ValueError(f"sandbox limits must be positive: {self}")
        if self.wall_s <= 0 or self.file_bytes < 0:
            raise ValueError(f"sandbox limits must be positive: {self}")


@dataclass(slots=True)
class SandboxResult:
    """One run: the exit status (negative: killed by that signal), the output, and
    ``limit`` naming the limit that stopped it (None if it ended by itself)."""

    returncode: int | None
    stdout: str
    stderr: str
    limit: str | None = None
    seconds: float = 0.0
    truncated: list[str] = field(default_factory=list)

    def observation(self) -> str:
        """stdout, stderr and a status line, as the model reads them."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr.rstrip()}")
        for stream in self.truncated:
            parts.append(f"[{stream} cut at the output limit]")
        parts.append(self._status())
        return "\n".join(parts)

    def _status(self) -> str:
        if self.limit is not None:
            return f"[stopped: {self.limit}]"
        if self.returncode == 0:
            return "[exit status 0]"
        if self.returncode is not None and self.returncode < 0:
            return f"[killed by {signal.Signals(-self.returncode).name}]"
        return f"[exit status {self.returncode}]"


class PythonSandbox:
    """Runs Python snippets under ``SandboxLimits``; ``run(code)`` gives a ``SandboxResult``."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        python: str = sys.executable,
        *,
        isolate: bool = True,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.python = python
        self.isolate = isolate
        if isolate and (why := landlock.problem()) is not None:
            raise ValueError(
                f"the python tool cannot isolate its snippets here: {why}; run on such a "
                "machine, or set isolate: false to run them with limits but no isolation"
            )
        arch = landlock.SECCOMP_ARCH.get(os.uname().machine) if isolate else None
        self._isolation = json.dumps([landlock.readable_roots(), *arch] if arch else None)

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` to its end or to a limit; the process group never outlives the call."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as cwd:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-I",
                "-S",
                "-B",
                "-c",
                _PREAMBLE,
                *self._limit_args(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=_environment(cwd),
                start_new_session=True,
            )
            try:
                result = await self._communicate(proc, code.encode())
            finally:
                _kill_group(proc)
                await proc.wait()
        result.returncode = proc.returncode if result.limit is None else result.returncode
        result.seconds = time.monotonic() - start
        return result

    async def _communicate(self, proc: asyncio.subprocess.Process, code: bytes) -> SandboxResult:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        result = SandboxResult(None, "", "")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(code)
            await proc.stdin.drain()
            proc.stdin.close()
        cap = self.limits.output_bytes
        out, err = _Capture("stdout", cap, proc), _Capture("stderr", cap, proc)
        try:
            async with asyncio.timeout(self.limits.wall_s), asyncio.TaskGroup() as tg:
                tg.create_task(out.read(proc.stdout))
                tg.create_task(err.read(proc.stderr))
                await proc.wait()
                # What it forked dies with it; a child holding the pipes would keep the
                # readers from ever seeing the end of the output.
                _kill_group(proc)
        except TimeoutError:
            result.limit = f"wall-clock limit of {self.limits.wall_s:g} s"
        if out.over or err.over:
            result.limit = result.limit or f"output limit of {cap} bytes"
        result.stdout, result.stderr = out.text(), err.text()
        result.truncated = [c.stream for c in (out, err) if c.over]
        if proc.returncode == -signal.SIGXCPU:
            result.limit = result.limit or f"CPU-time limit of {self.limits.cpu_s} s"
        elif proc.returncode == -signal.SIGKILL:  # not ours: the hard CPU limit, or the OOM killer
            result.limit = result.limit or "killed (CPU-time or memory limit)"
        return result

    def _limit_args(self) -> list[str]:
        lim = self.limits
        limits = (lim.cpu_s, lim.memory_mb << 20, lim.file_bytes, lim.open_files)
        return [*(str(v) for v in limits), self._isolation]

    async def __call__(self, code: str) -> str:
        return (await self.run(code)).observation()


class _Capture:
    """Reads one stream, keeping at most ``cap`` bytes; ``over`` once more arrived."""

    def __init__(self, stream: str, cap: int, proc: asyncio.subprocess.Process) -> None:
        self.stream, self.cap, self.over, self.proc = stream, cap, False, proc
        self._data = bytearray()

    async def read(self, reader: asyncio.StreamReader) -> None:
        while chunk := await reader.read(65536):
            room = self.cap - len(self._data)
            self._data += chunk[:room]
            if len(chunk) > room:
                self.over = True
                _kill_group(self.proc)  # a writer blocked on a full pipe would hang till wall_s
                return

    def text(self) -> str:
        return self._data.decode("utf-8", errors="replace")


#: Runs in the child before the snippet: argv = [cpu_s, address-space bytes, file bytes,
#: open files, JSON [readable roots, seccomp arch, socket syscall] or null (no
#: isolation)]; the snippet comes on stdin and runs as ``__main__``. (Not ``preexec_fn``:
#: it is unsafe in a process with threads, as actor processes are.)
_PREAMBLE = (
    landlock.PREAMBLE
    + """
import resource as _r, sys as _s, json as _j, os as _os
_c, _m, _f, _n = (int(x) for x in _s.argv[1:5])
_r.setrlimit(_r.RLIMIT_CPU, (_c, _c + 1))
_r.setrlimit(_r.RLIMIT_AS, (_m, _m))
_r.setrlimit(_r.RLIMIT_FSIZE, (_f, _f))
_r.setrlimit(_r.RLIMIT_NOFILE, (_n, _n))
_r.setrlimit(_r.RLIMIT_CORE, (0, 0))
_iso = _j.loads(_s.argv[5])
if _iso is not None:
    _landlock(_os.getcwd(), _iso[0])
    _no_sockets(_iso[1], _iso[2])
_src = _s.stdin.read()
_s.argv = ["<sandbox>"]
_g = {"__name__": "__main__", "__builtins__": __builtins__}
del _r, _s, _c, _m, _f, _n, _j, _os, _iso, _landlock, _no_sockets
exec(compile(_src, "<sandbox>", "exec"), _g)
"""
)


def _environment(cwd: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # Also after the program exited: a child it forked keeps the group alive.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


PYTHON_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "A Python 3 program; print results."}},
    "required": ["code"],
    "additionalProperties": False,
}


def python_tool(limits: SandboxLimits | None = None, *, isolate: bool = True) -> FunctionTool:
    """The sandbox as a registry tool named ``python``."""
    sandbox = PythonSandbox(limits, isolate=isolate)
    return FunctionTool(
        "python",
        "Run a Python 3 program in a sandbox and return its output (print what you need).",
        sandbox.__call__,
        PYTHON_PARAMETERS,
    )
