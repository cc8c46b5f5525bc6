"""Rotary position embeddings: frequencies per rope type, cos/sin tables, and their application.

Rotation is non-interleaved (GPT-NeoX style) over the first `rotary_dim` dims of each head; the rest pass
through (partial rotary, as Phi-4-mini's partial_rotary_factor asks).

LongRoPE ("longrope", Phi-3's "su") keeps two sets of frequency divisors, short and long. transformers
picks one set per forward pass: the long one when the pass's largest position + 1 exceeds
original_max_position_embeddings (the switch), else the short one (modeling_rope_utils.dynamic_rope_update);
and its Phi-3 generate() drops the KV cache when a sequence first grows past the switch
(Phi3ForCausalLM.prepare_inputs_for_generation), so the whole sequence is computed again with long factors.
So a sequence of up to `switch` tokens is rotated with short factors throughout, a longer one with long
factors throughout. Here a token's rotation depends on its position and on how many tokens its request
holds (AttentionMetadata.request_lens): table rows [0, max_positions) are indexed by position (short
factors below the switch, long ones from it), and rows from max_positions hold long factors for positions
below the switch, which the tokens of requests longer than the switch take. The engine recomputes a request
that grows past the switch (the model's kv_recompute_length), as generate() does. The attention factor
(from max_position_embeddings / original_max_position_embeddings unless the config gives it) scales cos and
sin of both sets, as in transformers. vLLM and llama.cpp instead choose one set for the whole run (long
when the configured context exceeds the original one), which needs no recompute but rotates short
sequences with long factors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.kernels.cpu import chunk_ops

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope", "yarn")


def _cpu_arange(n: int, step: int = 1) -> torch.Tensor:
    # On the CPU whatever the default device: under "meta" (models are built there) these ops would go
    # through torch's Python reference implementations, which import the compiler stack (~150 MiB resident).
    return torch.arange(0, n, step, dtype=torch.int64, device="cpu").float()


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the configured rope type (LongRoPE: its
    short set; long_rope_inv_freq gives the long one)."""
    inv_freq = 1.0 / (base ** (_cpu_arange(rotary_dim, 2) / rotary_dim))
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "freq_factors":  # GGUF's rope_freqs: llama3 scaling as one divisor per frequency
        return inv_freq / _factors(scaling["factors"], inv_freq, "rope frequency"), 1.0
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
    if rope_type == "longrope":
        return _longrope(rotary_dim, base, scaling["short_factor"], "short"), scaling["attention_factor"]
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn(dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency blends its interpolated (divided by factor) and original values by a linear ramp
    over the dimensions between the ones that turn beta_fast and beta_slow times within the original context;
    cos and sin scale by 0.1 ln(factor) + 1 (or by mscale / mscale_all_dim, or by attention_factor where
    given). As transformers computes it, roundings included."""
    factor, original = s.get("factor"), s.get("original_max_position_embeddings")
    if not factor or not original:
        raise ValueError(f"YaRN rope scaling needs factor and original_max_position_embeddings, got {s!r}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def turns(n: float) -> float:  # the dimension whose frequency turns n times in the original context
        return dim * math.log(original / (n * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns(fast), turns(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((_cpu_arange(dim // 2) - low) / (high - low), 0, 1)
    powers = base ** (_cpu_arange(dim, 2) / dim)
    keep = 1 - ramp  # the share of each frequency's original (extrapolated) value
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep, attention


def long_rope_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """LongRoPE's long set of inverse frequencies."""
    return _longrope(rotary_dim, base, scaling["long_factor"], "long")


def _longrope(rotary_dim: int, base: float, factors, which: str) -> torch.Tensor:
    # Rounded as transformers rounds it: 1 / (factor * base^(i/d)), not (1 / base^(i/d)) / factor.
    powers = base ** (_cpu_arange(rotary_dim, 2) / rotary_dim)
    return 1.0 / (_factors(factors, powers, f"LongRoPE {which}") * powers)


def rope_type_of(scaling: dict | None) -> str:
    """The rope type a scaling dict names ("default" for None)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _factors(values, inv_freq: torch.Tensor, what: str) -> torch.Tensor:
    factors = torch.tensor(values, dtype=torch.float32, device=inv_freq.device)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{factors.numel()} {what} factors for {inv_freq.numel()} frequencies")
    return factors


class RotaryEmbedding(nn.Module):
    """cos/sin tables [rows, rotary_dim] in float32 for positions below max_positions (see the module
    docstring for LongRoPE's extra rows)."""

    def __init__(self, rotary_dim: int, max_positions: int, base: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq, attn_factor = rope_inv_freq(rotary_dim, base, scaling)
        positions = _cpu_arange(max_positions)
        freqs = torch.outer(positions, inv_freq)
        self.max_positions = max_positions
        self.switch: int | None = None  # LongRoPE: sequences longer than this are rotated with long factors
        if rope_type_of(scaling) == "longrope":
            switch = scaling["original_max_position_embeddings"]
            long_inv = long_rope_inv_freq(rotary_dim, base, scaling)
            freqs = torch.where((positions < switch)[:, None], freqs, torch.outer(positions, long_inv))
            if switch < max_positions:  # only then can a sequence be longer than the switch
                self.switch = switch
                freqs = torch.cat([freqs, torch.outer(_cpu_arange(switch), long_inv)])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_factor, persistent=False)

    def rows(self, positions: torch.Tensor, request_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows of tokens at these positions whose requests hold request_lens tokens (None: rows
        by position alone, right for each request's last token)."""
        if self.switch is None or request_lens is None:
            return positions
        long = (request_lens > self.switch) & (positions < self.switch)
        return torch.where(long, positions + self.max_positions, positions)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               request_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim] for the tokens, once per forward pass (every layer shares them)."""
        rows = self.rows(positions, request_lens)
        return self.cos[rows].to(dtype).unsqueeze(1), self.sin[rows].to(dtype).unsqueeze(1)

    def position_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_positions, rotary_dim] float32 indexed by position: each request's last token (a
        decode step's) takes its row from these."""
        return self.cos[:self.max_positions].float(), self.sin[:self.max_positions].float()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, H, D], k: [T, KVH, D]; cos, sin: [T, 1, R] rotate the first R <= D dims of each head."""
    ops = chunk_ops(q)
    if ops is not None and k.dtype == cos.dtype == sin.dtype == torch.bfloat16 and cos.is_contiguous() \
            and sin.is_contiguous() and q.stride(-1) == 1 and k.stride(-1) == 1:
        return ops.rotary_bf16(q, cos, sin), ops.rotary_bf16(k, cos, sin)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def part(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., :r]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., r:]), dim=-1)
    return part(q), part(k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
