"""Handing freed heap memory back to the operating system.

glibc keeps the memory a program frees for its next allocations, and only shrinks a heap from its top. Its
threshold for serving a large block from a mapping of its own (unmapped on free) rises to the largest
block freed so far, so once a long prompt has passed, the temporaries of later steps come from the heaps,
in the sizes each batch and chunk length asks for, and free runs between live blocks stay resident.
malloc_trim(0) gives the pages inside free runs back (madvise) and keeps the heaps as they are. Under the
soak's load on the default model it takes ~3 ms; what it changes in the soak's RSS is in docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def release_freed_heap() -> None:
    """Give the free pages of every malloc arena back to the OS (glibc only; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
