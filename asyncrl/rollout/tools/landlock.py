"""Landlock for the Python sandbox: no access to the job's files, sockets or processes.

Landlock (Linux 5.13+, unprivileged) lets a process give up rights for itself and every
process it starts. The sandbox's child applies it in its preamble, after its rlimits and
before it reads the snippet (``sandbox.py``):

- file system: read and execute beneath the Python standard library and the system
  library folders (``readable_roots``), full access beneath the call's own temporary
  folder; nothing else, so the run directory, checkpoints, keys, the job's virtual
  environment and ``/proc`` are out of reach;
- network (ABI 4, Linux 6.7+): no TCP ``bind`` or ``connect`` at all, so no channel,
  engine or proxy of the job can be reached;
- scope (ABI 6, Linux 6.12+): no signals to processes outside the sandbox and no
  abstract UNIX sockets.

``abi()`` probes the kernel from the parent; a sandbox that asks for isolation on a
kernel below ``MIN_ABI`` is refused when the tool is built (before any process starts).
``PREAMBLE`` is the child's code: it runs under ``python -I -S``, so it uses ``ctypes``
and nothing of asyncrl. Syscall numbers 444-446 are the same on every architecture that
has Landlock (it came after the syscall tables were unified).
"""

from __future__ import annotations

import ctypes
import os
import sysconfig

#: Network rules (no TCP) need ABI 4; signal and abstract-socket scoping need ABI 6.
MIN_ABI = 4
_SYS_CREATE_RULESET = 444
_CREATE_RULESET_VERSION = 1


def abi() -> int:
    """The kernel's Landlock ABI version (0: not available)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_CREATE_RULESET_VERSION))  # fmt: skip
    return max(int(version), 0)


def readable_roots() -> list[str]:
    """Folders (and files) a snippet may read and execute: the standard library and the
    system's shared libraries (extension modules load them lazily), those that exist."""
    # The base interpreter's standard library, not a virtual environment's site-packages.
    paths = {sysconfig.get_path("stdlib"), os.path.dirname(os.__file__)}
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/etc/ld.so.cache",
              "/usr/share/zoneinfo", "/dev/null", "/dev/urandom"}  # fmt: skip
    return sorted(p for p in paths if os.path.exists(p))


#: Applied in the sandbox child: ``_landlock(work_dir, readable_roots)``. Raises OSError
#: when the kernel refuses (the child then exits before running anything).
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
    for _p, _rights in [(_work, _fs)] + [(p, _read) for p in _roots]:
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
"""
