"""Entry point of an actor process: ``python -m asyncrl.runtime.child < spec.json``.

The local runtime writes the ``ActorSpec`` as JSON to its stdin (a zygote's fork calls
``main`` instead). Exit codes: 0 stopped cleanly, 1 the actor failed, 2 the spec or
class could not load.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys

import msgspec
import uvloop

from asyncrl.actors.base import Actor, ActorSpec
from asyncrl.observe.logs import configure_logging
from asyncrl.plugins import load_object
from asyncrl.runtime.run_dir import keep_lock_to_self
from asyncrl.runtime.tether import tie_to_parent
from asyncrl.wire import security


def raise_open_file_limit() -> None:
    """Lift the soft open-file limit to the hard one, as SGLang's servers do at start.

    A rollout actor holds a socket per request in flight; the usual soft limit of 1,024
    would fail connects with EMFILE long before the engines are full.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # a hard limit the kernel refuses
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def limit_threads(threads: int | None) -> None:
    """Give this process ``threads`` OpenMP/torch threads: several torch processes on few
    cores, each with one thread per core, spin against each other."""
    if threads is None:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)  # before torch is imported, it reads them
    # An OpenMP thread that waits spins first (libgomp: about 300k turns) and takes a core
    # another process could use; passive, it sleeps at once.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def load_actor(raw: bytes) -> Actor:
    """Decode a spec and build its actor; ``ValueError`` with the reason otherwise."""
    try:
        spec = msgspec.json.decode(raw, type=ActorSpec)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"invalid actor spec: {exc}") from None
    limit_threads(spec.threads)
    cls = load_object(spec.cls, what="actor class")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"{spec.cls} is not an asyncrl Actor subclass")
    configure_logging(
        level=spec.log_level,
        fmt=spec.log_format,
        file=spec.log_file,
        actor=spec.name,
        role=spec.role,
        pid=os.getpid(),
    )
    try:  # before any channel opens: CurveZMQ when the job has keys
        security.enable_from_config(spec.wire)
    except ValueError as exc:
        raise ValueError(f"wire.curve_keys: {exc}") from None
    return cls(spec)


def main() -> None:
    """Read the spec from stdin, run the actor, exit with its code."""
    tie_to_parent(signal.SIGTERM)  # no actor outlives its job (else: the heartbeat)
    raise_open_file_limit()
    keep_lock_to_self()
    try:
        actor = load_actor(sys.stdin.buffer.read())
    except ValueError as exc:
        print(f"asyncrl actor: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    actor.exit_watchdog = True  # a stop ends this process in bounded time
    sys.exit(uvloop.run(actor.main()))


if __name__ == "__main__":
    main()
