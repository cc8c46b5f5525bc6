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

import torch

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


def int8_product_supported(device: torch.device) -> bool:
    """Whether torch has a weight-only int8 product on this device."""
    if device.type == "cuda":
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")
    return device.type == "cpu"


class Int8Weight:
    """A [n, k] weight as int8 codes and a float32 scale per row; the quantized-weight interface of the
    linear layers (layers._QuantizableLinear): matmul, shape, nbytes, name, cat, dequantize."""

    __slots__ = ("codes", "scales", "shape", "_product", "_scales_as")
    name = FORMAT
    qtype = None  # no GGML type: the CPU's fused decode step does not take it

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dtype != torch.int8 or codes.dim() != 2 or scales.shape != codes.shape[:1]:
            raise ValueError(f"int8 weights need codes [n, k] of int8 and scales [n], got {tuple(codes.shape)} "
                             f"{codes.dtype} and {tuple(scales.shape)}")
        self.codes, self.scales = codes.contiguous(), scales.float().contiguous()
        self.shape = tuple(codes.shape)
        self._product = int8_product_supported(codes.device)
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}  # the scales in each activation dtype seen

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight") -> Int8Weight:
        if w.dim() != 2:
            raise ValueError(f"{name}: int8 quantizes matrices, got shape {tuple(w.shape)}")
        return cls(*_codes(w))

    @classmethod
    def cat(cls, parts: list[Int8Weight]) -> Int8Weight:
        """The parts' rows one after another (a merged projection's q, k and v)."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scales.unsqueeze(-1)).to(dtype)

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
