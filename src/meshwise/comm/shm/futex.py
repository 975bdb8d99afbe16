"""Sleeping on a shared counter until a peer changes it: Linux futexes on the mapped segments.

When ranks outnumber cores (4 ranks on 2 cores), a rank that spins or yields while waiting for a peer
takes the core that peer needs to get anywhere: measured on 2 cores, one ``sched_yield`` handed the core
away for ~0.8 ms while the awaited copy took 0.1 ms. A futex wait instead puts the waiter to sleep in
the kernel and the poster wakes it the moment it publishes. The futex word is the low half of an int64
counter in a segment every rank maps (x86-64 is little-endian), so the non-private futex operations
apply: the kernel keys them by the shared page, not by the process.

Only the waker's syscall is paid per publish, and only when a peer announced that it sleeps (see
:meth:`meshwise.comm.shm.phase.PhaseEngine.post`), so ranks that never sleep never pay for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

_SYS_FUTEX = 202  # x86-64 (the only machine the shm backend runs on: segment.check_memory_model)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 2**31 - 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (its low 32 bits), at most ``seconds``.

    Returns on a wake-up, a changed word, the timeout or a signal alike: callers re-check their condition
    in a loop, so no outcome needs telling apart (any other error is a programming error and raises)."""
    whole = int(seconds)
    limit = _Timespec(whole, int((seconds - whole) * 1e9))
    low = ctypes.c_uint32(expected & 0xFFFFFFFF).value
    if _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, low, ctypes.byref(limit), None, 0) == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait failed: {errno.errorcode.get(code, code)}")


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``address``."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
