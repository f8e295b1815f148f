"""Isolation for the Python sandbox: no access to the job's files, sockets or processes.

The sandbox's child applies it (``PREAMBLE``) after its rlimits and before it reads the
snippet; both mechanisms are unprivileged and inherited by every process the snippet
starts. Landlock: read and execute beneath ``readable_roots``, full access beneath the
call's own folder, no TCP, no signals out of the sandbox, no abstract UNIX sockets.
seccomp: ``socket()`` and ``io_uring_setup()`` fail with EPERM, which closes what Landlock
leaves open (UDP, raw sockets, UNIX socket files); ``socketpair()`` still works.
"""

from __future__ import annotations

import ctypes
import os
import sysconfig

#: Network rules (no TCP) came with ABI 4, signal and abstract-socket scoping with ABI 6.
MIN_ABI = 6
# Landlock's syscalls (444-446) and io_uring_setup (425) have one number on every
# architecture (they came after the tables were unified); ``socket``'s differs.
_SYS_CREATE_RULESET = 444
_CREATE_RULESET_VERSION = 1
#: seccomp's audit arch and ``socket`` syscall number per machine.
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}


def abi() -> int:
    """The kernel's Landlock ABI version (0: not available)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(
        _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    return max(int(version), 0)


def problem() -> str | None:
    """Why this machine cannot isolate a snippet; None when it can."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        return f"the socket filter knows x86_64 and aarch64, not {machine}"
    found = abi()
    if found < MIN_ABI:
        return (
            f"it needs Landlock ABI >= {MIN_ABI} (Linux 6.12+), this kernel has {found or 'none'}"
        )
    return None


def readable_roots() -> list[str]:
    """Folders (and files) a snippet may read and execute: the standard library and the
    system's shared libraries (extension modules load them lazily), those that exist."""
    # The base interpreter's standard library, not a virtual environment's site-packages.
    paths = {sysconfig.get_path("stdlib"), os.path.dirname(os.__file__)}
    paths |= {
        "/usr/lib",
        "/usr/lib64",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
        "/usr/share/zoneinfo",
        "/dev/urandom",
    }
    return sorted(p for p in paths if os.path.exists(p))


#: Applied in the sandbox child: ``_landlock(work_dir, readable_roots)``, then
#: ``_no_sockets()``. Each raises OSError when the kernel refuses (the child then exits
#: before running anything). It runs under ``python -I -S``: ``ctypes``, nothing of asyncrl.
PREAMBLE = r"""
def _landlock(_work, _roots):
    import ctypes as _c, os as _o
    _libc = _c.CDLL(None, use_errno=True)
    _libc.syscall.restype = _c.c_long
    def _call(*args):
        r = _libc.syscall(*args)
        if r < 0:
            e = _c.get_errno()
            raise OSError(e, "landlock: " + _o.strerror(e))
        return r
    _abi = _call(444, None, _c.c_size_t(0), _c.c_uint32(1))
    _fs = (1 << 13) - 1  # execute .. make_sym (ABI 1)
    if _abi >= 2: _fs |= 1 << 13  # refer
    if _abi >= 3: _fs |= 1 << 14  # truncate
    if _abi >= 5: _fs |= 1 << 15  # ioctl_dev
    class _Ruleset(_c.Structure):
        _fields_ = [("fs", _c.c_uint64), ("net", _c.c_uint64), ("scoped", _c.c_uint64)]
    class _Path(_c.Structure):
        _pack_ = 1
        _fields_ = [("allowed", _c.c_uint64), ("fd", _c.c_int32)]
    _attr = _Ruleset(_fs, 3 if _abi >= 4 else 0, 3 if _abi >= 6 else 0)
    _size = 8 if _abi < 4 else (16 if _abi < 6 else 24)
    _rs = _call(444, _c.byref(_attr), _c.c_size_t(_size), _c.c_uint32(0))
    _read = 1 | 4 | 8  # execute, read_file, read_dir
    _file = 1 | 2 | 4 | ((1 << 14) if _abi >= 3 else 0)  # rights that apply to a file
    _rules = [(_work, _fs), ("/dev/null", 2 | 4)] + [(p, _read) for p in _roots]
    for _p, _rights in _rules:
        _fd = _o.open(_p, _o.O_PATH | _o.O_CLOEXEC)
        try:
            if not _o.path.isdir(_p):
                _rights &= _file
            _rule = _Path(_rights, _fd)
            _call(445, _rs, _c.c_int(1), _c.byref(_rule), _c.c_uint32(0))
        finally:
            _o.close(_fd)
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: required to restrict oneself
    _call(446, _rs, _c.c_uint32(0))
    _o.close(_rs)

def _no_sockets(_arch, _socket_nr):
    import ctypes as _c
    class _Insn(_c.Structure):
        _fields_ = [("code", _c.c_uint16), ("jt", _c.c_uint8), ("jf", _c.c_uint8),
                    ("k", _c.c_uint32)]
    class _Prog(_c.Structure):
        _fields_ = [("len", _c.c_uint16), ("filter", _c.POINTER(_Insn))]
    _deny = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
    _code = [
        (0x20, 0, 0, 4),            # A = seccomp_data.arch
        (0x15, 0, 5, _arch),        # another arch: deny
        (0x20, 0, 0, 0),            # A = seccomp_data.nr
        (0x54, 0, 0, 0xBFFFFFFF),   # drop x86's x32 bit
        (0x15, 2, 0, _socket_nr),   # socket(): deny
        (0x15, 1, 0, 425),          # io_uring_setup(): deny (it can make sockets)
        (0x06, 0, 0, 0x7FFF0000),   # allow
        (0x06, 0, 0, _deny),
    ]
    _insns = (_Insn * len(_code))(*[_Insn(*i) for i in _code])
    _prog = _Prog(len(_code), _insns)
    _libc = _c.CDLL(None, use_errno=True)
    if _libc.prctl(22, 2, _c.byref(_prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        _e = _c.get_errno()
        raise OSError(_e, "seccomp: could not install the socket filter")
"""
