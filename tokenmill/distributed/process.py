"""What a process started by another (a tensor-parallel rank, a data-parallel replica) does to end with it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the parent dies (Linux: PR_SET_PDEATHSIG, which fires when the parent's
    thread that started this process ends); if the parent has died already, leave now."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
