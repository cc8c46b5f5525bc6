"""FP8 weights (e4m3) with a scale per output channel, multiplied by torch's scaled matrix product.

quantization="fp8" turns each float linear weight W [n, k] into codes C = round_e4m3(W / s) with
s = max|W[row]| / 448 per row (448 is e4m3's largest value), one byte a weight. A product takes the
activations to e4m3 as well, each row with a scale of its own (dynamic, per token), and runs
torch._scaled_mm(x codes, C^T, x scales, s): on GPUs with FP8 tensor cores (compute capability 8.9 and
up: Ada, Hopper) that is the hardware's FP8 product, about half the bytes of bfloat16 read per decode
step. Where torch has no FP8 product on the device, the codes are dequantized for an ordinary product
(weights still stored in one byte each). torch runs the same product on the CPU (slowly: the CPU's own
formats, int8 and the GGUF blocks, are its fast path), which is how tests check it without a GPU.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.channel import ChannelWeight

E4M3_MAX = 448.0
FORMAT = "FP8_E4M3"


def _codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scales [rows]) of a float matrix [rows, cols], a scale per row."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    return (xf / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scales


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether torch multiplies FP8 matrices on this device (the CPU; CUDA from compute capability 8.9)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


class Fp8Weight(ChannelWeight):
    """A [n, k] weight as e4m3 codes and a float32 scale per row."""

    __slots__ = ("_scaled_mm",)
    name = FORMAT
    _codes = staticmethod(_codes)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__(codes, scales)
        self._scaled_mm = scaled_mm_supported(codes.device)

    def matmul(self, x: torch.Tensor, float_from: int | None = None) -> torch.Tensor:
        """x [..., k] @ W^T in x's dtype; float_from is the CPU block formats' and is not used here."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if not self._scaled_mm:
            return (x2 @ self.dequantize(x.dtype).t()).reshape(*lead, self.shape[0])
        codes, scales = _codes(x2)
        # CUDA's row-wise scaled product writes bfloat16; the CPU's writes x's dtype as well.
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(codes, self.codes.t(), scale_a=scales.unsqueeze(-1), scale_b=self.scales.unsqueeze(0),
                             out_dtype=out_dtype)
        return y.to(x.dtype).reshape(*lead, self.shape[0])
