"""Weights on the CPU in one contiguous buffer, backed by huge pages where the kernel allows it.

A decode step streams every weight from memory once. Two things cost bandwidth when each tensor is
allocated on its own: every 4 KiB page needs its own TLB entry (a 270 MB model spans ~66,000 pages,
far more than the TLB holds, so the stream stalls on page walks), and separate allocations break the
stream the prefetchers follow. Here all parameters are slices of one buffer, laid out in the order
the modules were registered (the order a forward pass reads them), and the buffer is advised to use
2 MiB transparent huge pages before anything is written to it.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
from torch import nn

logger = logging.getLogger("tokenmill")

_HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line
_MADV_HUGEPAGE = 14


def _advise_huge_pages(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of nbytes whose memory is advised to use huge pages (where possible)."""
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    buf = raw[start:start + nbytes]
    _advise_huge_pages(buf.data_ptr(), nbytes - nbytes % _HUGE_PAGE)
    return buf


def materialize(model: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Give each parameter of a model built on the meta device a slice of one CPU buffer (in dtype).

    Buffers still on the meta device get ordinary CPU tensors (floating ones in dtype). Returns the
    buffer (uint8), which the parameters keep alive."""
    params = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    itemsize = torch.empty((), dtype=dtype).element_size()
    offsets: dict[int, int] = {}  # id(parameter) -> byte offset; a shared parameter gets one slice
    total = 0
    for _, _, p in params:
        if id(p) not in offsets:
            offsets[id(p)] = total
            total += -(-p.numel() * itemsize // _ALIGN) * _ALIGN
    arena = huge_page_buffer(total)
    placed: dict[int, nn.Parameter] = {}
    for module, name, p in params:
        if id(p) not in placed:
            off = offsets[id(p)]
            view = arena[off:off + p.numel() * itemsize].view(dtype).view(p.shape)
            placed[id(p)] = nn.Parameter(view, requires_grad=False)
        module._parameters[name] = placed[id(p)]
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
    return arena
