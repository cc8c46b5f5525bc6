"""Handing freed heap memory back to the operating system.

glibc keeps the memory a program frees for its next allocations, and only shrinks a heap from its top. Its
threshold for serving a large block from a mapping of its own (unmapped on free) rises to the largest
block freed so far, so once a long prompt has passed, the temporaries of later steps come from the heaps,
in the sizes each batch and chunk length asks for, and free runs between live blocks stay resident.
malloc_trim(0) gives the pages inside free runs back (madvise) and keeps the heaps as they are. Under the
soak's load on the default model it takes ~3 ms; what it changes in the soak's RSS is in docs/benchmarks.md.

It shrinks only the main arena's top, though: each other arena (glibc gives new threads arenas of their own,
up to 8 per CPU) keeps the free memory at its top, up to the trim threshold, which rises with the largest
temporaries to tens of MiB. In a server, whose threads (the engine's, the kernels', the event loop's executor)
each had an arena, one such arena held 55 MiB more to the end of a short soak, through every trim. A server
process therefore keeps every thread on the main arena (one_malloc_arena); threads' small allocations still
come from their own caches, without the arena's lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_M_ARENA_MAX = -8  # mallopt's parameter number


def one_malloc_arena() -> bool:
    """Let threads that allocate for the first time after this call share the main malloc arena, where
    release_freed_heap reaches all of the free memory (glibc only: True where it took effect). Call it before
    the process starts its threads; TOKENMILL_MALLOC_ARENAS=default keeps glibc's choice."""
    if os.environ.get("TOKENMILL_MALLOC_ARENAS", "one") == "default" or _malloc_trim() is None:  # not glibc
        return False
    return _libc().mallopt(_M_ARENA_MAX, 1) == 1


@functools.cache
def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)  # None where not glibc: nothing to do


def release_freed_heap() -> None:
    """Give the free pages of every malloc arena back to the OS (glibc only; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
