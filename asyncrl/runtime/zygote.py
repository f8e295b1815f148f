"""The fork server: ``python -m asyncrl.runtime.zygote FD``, a process that has imported
torch, transformers and the actor classes once and forks each local actor from there, so
an actor's start or restart costs a fork, not seconds of imports.

Protocol over the ``SOCK_SEQPACKET`` socket ``FD`` (one msgspec-JSON message per packet):
    <- {"ready": true} | {"error": traceback}      once, after the imports
    -> {"env": {...}, "cwd": str, "fd_env": [name, ...]}
                                     + fds [stdin, output, *inherited]
    <- {"pid": n} | {"error": str}                   one per request, in order
    <- {"exit": n, "code": c}                        when child n ends (c < 0: signal -c)

It never starts a thread, an event loop or a CUDA context, so forking it is as safe as
forking a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import socket
import sys
import traceback

import msgspec

#: Imported once here, so that no actor imports them again.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.tokenization_utils_fast",
    "asyncrl.runtime.child",
    "asyncrl.actors.buffer",
    "asyncrl.actors.engine",
    "asyncrl.actors.eval",
    "asyncrl.actors.rollout",
    "asyncrl.actors.trainer",
)
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16


def preload() -> None:
    """Import :data:`PRELOAD`; ``transformers`` resolves its lazy names on first use."""
    for name in PRELOAD:
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoConfig"):
        getattr(transformers, name)


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(msgspec.json.encode(message))


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Zygote:
    """The serving loop: fork on request, report each child's exit."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.start_dir = sys.path[0]
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the selector
        self.selector = selectors.DefaultSelector()

    def serve(self) -> None:
        """Until the controller hangs up (or its end of the socket fails)."""
        selector = self.selector
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self.wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is self.sock and not self._request():
                    return
                if key.fileobj == self.wake_r:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        os.read(self.wake_r, 4096)
            self._reap()

    def _request(self) -> bool:
        """Serve one request; False once the controller is gone."""
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, _MAX_FDS)
        except ConnectionError:
            return False
        if not data:
            return False
        try:
            request = msgspec.json.decode(data)
            env, names = dict(request["env"]), list(request.get("fd_env", []))
            if len(fds) != 2 + len(names):  # cut short (MSG_CTRUNC): never mislabel one
                raise ValueError(f"{len(fds)} descriptors for {2 + len(names)}")
            # each inherited descriptor's number, as this side received it
            env.update(zip(names, map(str, fds[2:]), strict=True))
            pid = self._fork(env, request["cwd"], fds)
        except Exception as exc:  # a malformed request fails alone
            _send(self.sock, {"error": f"{type(exc).__name__}: {exc}"})
        else:
            _send(self.sock, {"pid": pid})
        finally:
            _close(fds)
        return True

    def _fork(self, env: dict[str, str], cwd: str, fds: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_actor(env, cwd, fds)  # never returns
        self.children.add(pid)
        return pid

    def _become_actor(self, env: dict[str, str], cwd: str, fds: list[int]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh python's
            self.selector.close()
            _close([self.sock.detach(), self.wake_r, self.wake_w])
            os.setsid()  # a group of its own, as the exec path's start_new_session
            stdin, output, *inherited = fds
            os.dup2(stdin, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            _close([stdin, output])
            for fd in inherited:
                os.set_inheritable(fd, True)
            os.chdir(cwd)
            # ``python -m`` put the zygote's directory first on the path; an exec'd actor
            # has its own there (a plugin or test module next to the job is found so)
            if sys.path and sys.path[0] == self.start_dir:
                sys.path[0] = cwd
            sys.argv = [child_path()]
            os.environ.clear()
            os.environ.update(env)
            code = _run_actor()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            _send(self.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def child_path() -> str:
    """``sys.argv[0]`` of an exec'd actor (``python -m asyncrl.runtime.child``)."""
    from asyncrl.runtime import child

    return str(child.__file__)


def _run_actor() -> int:
    """What ``python -m asyncrl.runtime.child`` does, in this fork, and what an
    interpreter does at exit: join non-daemon threads, then run ``atexit``."""
    import atexit
    import threading

    import numpy as np

    from asyncrl.runtime import child

    np.random.seed()  # a fork shares numpy's global stream with its siblings; torch and
    # random differ as they would in a fresh process (torch's default seed is fixed)
    code = 1
    try:
        child.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    return code


def main() -> None:
    """Preload, say ready, serve; exit without tearing the interpreter down once the
    controller's end of the socket closes (not ``PR_SET_PDEATHSIG``: it fires when the
    *thread* that started the zygote ends, and a controller starts it from a worker
    thread). SIGTERM and SIGINT are ignored: a stop sent to every process of the job is
    the controller's to order, actor by actor."""
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        preload()
    except BaseException:
        _send(sock, {"error": traceback.format_exc()})
        sys.exit(1)
    try:
        _send(sock, {"ready": True})
        Zygote(sock).serve()
    except OSError:  # the controller's end failed: as a hang-up
        pass
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
