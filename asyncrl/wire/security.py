"""CurveZMQ on every channel: encryption and mutual authentication with one job certificate.

``asyncrl keys DIR`` writes it (``generate``); with ``--wire.curve-keys DIR`` every process
of the job calls ``enable(DIR)`` before it opens a channel. From then on a bound socket is
a CURVE server, a connecting one a client that expects the server to hold the job's key,
and a ZAP handler admits only peers holding its secret (whoever can read the secret file
is part of the job). Only then may endpoints be non-loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.security")

CERT_NAME = "job"
ZAP_DOMAIN = "asyncrl"


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """The job certificate: its directory and key pair (Z85 bytes)."""

    directory: Path
    public: bytes
    secret: bytes

    def server(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def client(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of a job server (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public


_active: JobKeys | None = None
_authenticator: ThreadAuthenticator | None = None


def generate(directory: str | Path) -> tuple[Path, Path]:
    """Write a new job certificate into ``directory`` (created, mode 0700); refuses to
    overwrite one. Returns the public and secret key files."""
    directory = Path(directory)
    public, secret = directory / f"{CERT_NAME}.key", directory / f"{CERT_NAME}.key_secret"
    if public.exists() or secret.exists():
        raise FileExistsError(f"{directory} already holds a job certificate; use a new folder")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    made_public, made_secret = zmq.auth.create_certificates(directory, CERT_NAME)
    os.chmod(made_secret, 0o600)
    return Path(made_public), Path(made_secret)


def load(directory: str | Path) -> JobKeys:
    """Read the job certificate in ``directory``; ``ValueError`` says what is wrong."""
    directory = Path(directory)
    secret_file = directory / f"{CERT_NAME}.key_secret"
    if not secret_file.is_file():
        raise ValueError(f"{secret_file} not found: make one with `asyncrl keys {directory}`")
    if secret_file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{secret_file} is readable by others: chmod 600 it")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{secret_file} is not a CurveZMQ certificate: {exc}") from None
    if not public or not secret:
        raise ValueError(f"{secret_file} lacks a public or secret key")
    return JobKeys(directory, public, secret)


def enable(directory: str | Path) -> JobKeys:
    """Turn CURVE on for every socket this process binds or connects from now on, and
    start the ZAP handler that admits only the job's key. Idempotent for one directory."""
    global _active, _authenticator
    keys = load(directory)
    if _active is not None:
        if _active.directory.resolve() != keys.directory.resolve():
            raise ValueError(f"CurveZMQ is already enabled with {_active.directory}")
        return _active
    from asyncrl.wire.sockets import context

    if _authenticator is None:  # one per process: its inproc ZAP endpoint outlives a stop
        _authenticator = ThreadAuthenticator(zmq.Context.shadow(context().underlying))
        _authenticator.start()
    _authenticator.configure_curve(domain=ZAP_DOMAIN, location=str(keys.directory))
    _active = keys
    log.info("curve enabled", keys=str(keys.directory))
    return keys


def active() -> JobKeys | None:
    """The job keys when CURVE is enabled in this process, else None."""
    return _active


def disable() -> None:
    """Turn CURVE off again (tests; a job run in a process that runs others). The ZAP
    handler stays (its inproc endpoint cannot be bound twice in quick succession),
    admitting no one: only CURVE servers consult it, none are made while CURVE is off,
    and ``enable`` points it at the next job's keys."""
    global _active
    if _authenticator is not None:
        _authenticator.certs.pop(ZAP_DOMAIN, None)  # an unknown domain: everyone refused
    _active = None


def enable_from_config(wire: Any) -> JobKeys | None:
    """``enable(wire.curve_keys)`` when set (``wire`` is ``WireConfig`` or its dict)."""
    keys = wire.get("curve_keys") if isinstance(wire, dict) else wire.curve_keys
    return enable(keys) if keys else None


@contextlib.contextmanager
def enabled_for(wire: Any) -> Iterator[JobKeys | None]:
    """``enable_from_config`` for the duration of a ``with`` (a job run in a process
    that may run others, e.g. tests); turned off again only if this call turned it on."""
    was_on = _active is not None
    keys = enable_from_config(wire)
    try:
        yield keys
    finally:
        if keys is not None and not was_on:
            disable()
