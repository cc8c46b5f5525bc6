"""Weights of one byte a value with a float32 scale per output channel (row): what the FP8 (kernels/fp8.py)
and the torch int8 (kernels/int8.py) formats share. A subclass gives the rounding (_codes) and the
product (matmul)."""

from __future__ import annotations

import torch


class ChannelWeight:
    """A [n, k] weight as codes and a float32 scale per row; the quantized-weight interface of the linear
    layers (layers._QuantizableLinear): matmul, shape, nbytes, name, cat, dequantize."""

    __slots__ = ("codes", "scales", "shape")
    name = ""  # the format's name in logs
    qtype = None  # no GGML type: the CPU's fused decode step does not take it

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dim() != 2 or scales.shape != codes.shape[:1]:
            raise ValueError(f"{self.name} weights need codes [n, k] and scales [n], got {tuple(codes.shape)} "
                             f"and {tuple(scales.shape)}")
        self.codes, self.scales = codes.contiguous(), scales.float().contiguous()
        self.shape = tuple(codes.shape)

    @staticmethod
    def _codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, float32 scales [rows]) of a float matrix."""
        raise NotImplementedError

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight") -> ChannelWeight:
        if w.dim() != 2:
            raise ValueError(f"{name}: {cls.name} quantizes matrices, got shape {tuple(w.shape)}")
        return cls(*cls._codes(w))

    @classmethod
    def cat(cls, parts: list[ChannelWeight]) -> ChannelWeight:
        """The parts' rows one after another (a merged projection's q, k and v)."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scales.unsqueeze(-1)).to(dtype)

    def matmul(self, x: torch.Tensor, float_from: int | None = None) -> torch.Tensor:
        """x [..., k] @ W^T in x's dtype; float_from is the CPU block formats' and is not used here."""
        raise NotImplementedError
