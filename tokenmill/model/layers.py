"""Building blocks shared by the decoder models: norm, rotary embedding, MLP, fused linear layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu import linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementations do; the scale applies in the model dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the configured rope type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Non-interleaved (GPT-NeoX style) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq, attn_factor = _rope_inv_freq(head_dim, base, scaling)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_factor, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for the positions, once per forward pass (every layer shares them)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, H, D], k: [T, KVH, D]; cos, sin: [T, 1, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MergedLinear(nn.Module):
    """Several linear projections of the same input stored as one matrix (fewer, larger matmuls).

    load_shard() fills one part from a checkpoint tensor; the quantization seam lives here later.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_shard(self, index: int, tensor: torch.Tensor, is_bias: bool = False) -> None:
        start = sum(self.out_sizes[:index])
        target = self.bias if is_bias else self.weight
        expected = (self.out_sizes[index],) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            target[start:start + self.out_sizes[index]].copy_(tensor)


class Linear(nn.Linear):
    """nn.Linear whose small-batch bf16 products go through the decode kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
