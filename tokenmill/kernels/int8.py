"""int8 weights with a scale per output channel, multiplied by torch's weight-only int8 product.

Where tokenmill's own CPU kernels run quantization "int8" (Q8_0 blocks, kernels/quant.py), this is not
used. It is the "int8" of every other place: a GPU, and a CPU where those kernels could not be built (no
C++ compiler). Each float linear weight W [n, k] becomes codes C = round(W / s), clamped to +-127, with
s = max|W[row]| / 127 per row: one byte a weight. A product keeps its activations in their float type and
runs torch._weight_int8pack_mm(x, C, s), which reads the int8 codes and applies the scales itself (CPU;
CUDA in the torch releases that have it). Where torch has no such product for the device or dtype, the
codes are dequantized for an ordinary product (the weights still stored in one byte each).
"""

from __future__ import annotations

import functools

import torch

from tokenmill.kernels.channel import ChannelWeight

FORMAT = "INT8"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 scales [rows]) of a float matrix, a scale per row (codes rounded to nearest).
    Each scale is the bfloat16 value at or just above max|W[row]| / 127: the product takes its scales in
    the activations' dtype, and a scale that bfloat16 holds is the same number in float32 and bfloat16 (and
    in float16 above its smallest normal, 6e-5); rounding it there instead would scale a whole row by up to
    0.4%."""
    wf = w.float()
    exact = wf.abs().amax(dim=-1).clamp(min=1e-30) / 127
    held = exact.to(torch.bfloat16)
    held = torch.where(held.float() < exact, torch.nextafter(held, torch.full_like(held, float("inf"))), held)
    scales = held.float()
    return (wf / scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scales


@functools.cache
def int8_product_supported(device: torch.device) -> bool:
    """Whether torch has a weight-only int8 product on this device: on a GPU, one that runs a row of
    bfloat16 (tried once, on a small product; a torch whose kernel is missing or refuses those shapes
    gets the dequantizing path rather than a failing first step)."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm",
                                                                                     "CUDA"):
        return False
    try:
        x = torch.ones(1, 64, dtype=torch.bfloat16, device=device)
        w = torch.ones(64, 64, dtype=torch.int8, device=device)
        y = torch._weight_int8pack_mm(x, w, torch.full((64,), 0.5, dtype=torch.bfloat16, device=device))
        return bool((y == 32).all())
    except RuntimeError:
        return False


class Int8Weight(ChannelWeight):
    """A [n, k] weight as int8 codes and a float32 scale per row."""

    __slots__ = ("_product", "_scales_as")
    name = FORMAT
    _codes = staticmethod(_codes)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dtype != torch.int8:
            raise ValueError(f"int8 weights need int8 codes, got {codes.dtype}")
        super().__init__(codes, scales)
        self._product = int8_product_supported(codes.device)
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}  # the scales in each activation dtype seen

    def matmul(self, x: torch.Tensor, float_from: int | None = None) -> torch.Tensor:
        """x [..., k] @ W^T in x's dtype; float_from is the CPU block formats' and is not used here."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self._product and x.dtype in _DTYPES:
            scales = self._scales_as.get(x.dtype)
            if scales is None:  # the op takes its scales in the activations' dtype
                scales = self._scales_as[x.dtype] = self.scales.to(x.dtype)
            y = torch._weight_int8pack_mm(x2.contiguous(), self.codes, scales)
        else:
            y = x2 @ self.dequantize(x.dtype).t()
        return y.reshape(*lead, self.shape[0])
