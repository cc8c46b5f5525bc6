"""KV cache formats: values in the model's dtype ("auto"), or 8-bit codes with a scale per token and KV head.

An 8-bit cache keeps, for every cache slot and KV head, one row of head_dim codes and one bfloat16 scale:
value = code * scale, scale = the row's largest magnitude / the code's largest value (127 for int8, 448
for fp8 e4m3). A row is quantized once, when its token is written, so a scale never has to change as
a block fills up; the scale costs 2 bytes per row (3% of a 64-value row).

The CPU kernels read the codes in place (tokenmill/kernels/cpu_kernels.cpp) and write them with the same
operations in the same order as KVCache.write here, so a token's cache row does not depend on which path
computed it.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_ALIASES = {"fp8_e4m3": "fp8"}


def normalize(name: str) -> str:
    """The KV cache dtype `name` (vLLM's names; fp8_e4m3 is fp8), or a ValueError listing the choices."""
    name = _ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp8_e4m3), got {name!r}")
    return name


_CODES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def bytes_per_row(kv_cache_dtype: str, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) row of one KV head takes in the cache."""
    if kv_cache_dtype == "auto":
        return head_dim * dtype.itemsize
    return head_dim + 2  # codes and a bfloat16 scale


class KVCache:
    """One layer's K or V cache in 8 bits: codes [slots, KV heads, head_dim] (int8 or float8_e4m3fn) and
    scales [slots, KV heads] (bfloat16)."""

    __slots__ = ("codes", "scales", "kind", "qmax")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, kind: str) -> None:
        self.codes, self.scales, self.kind = codes, scales, kind
        self.qmax = _CODES[kind][1]

    @classmethod
    def allocate(cls, kind: str, slots: int, kv_heads: int, head_dim: int, new_tensor) -> KVCache:
        """new_tensor(shape, dtype) gives a zeroed tensor."""
        code_dtype = _CODES[kind][0]
        return cls(new_tensor((slots, kv_heads, head_dim), code_dtype), new_tensor((slots, kv_heads), torch.bfloat16),
                   kind)

    def data_ptr(self) -> int:
        return self.codes.data_ptr()

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of rows x [..., KV heads, head_dim]."""
        xf = x.float()
        amax = xf.abs().amax(dim=-1)
        # A row holding NaN or infinity keeps no codes, and a NaN scale: it reads back as NaN.
        scales = torch.where(amax.isfinite(), amax / self.qmax, float("nan")).to(torch.bfloat16)
        s = scales.float().unsqueeze(-1)
        v = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0).clamp_(-self.qmax, self.qmax)
        codes = v.round_().to(torch.int8) if self.kind == "int8" else v.to(torch.float8_e4m3fn)
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """code * scale in dtype. Codes and bfloat16 scales are exact in bfloat16 and float32, and their
        product is exact in float32, so those multiply in dtype directly (one rounding, no float32 copy);
        float16 goes through float32 (a bfloat16 scale may lie outside its range)."""
        if dtype in (torch.bfloat16, torch.float32):
            return codes.to(dtype) * scales.to(dtype).unsqueeze(-1)
        return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Stores rows x [T, KV heads, head_dim] at `slots`; returns the values the cache now holds for
        them (x as read back), in x's dtype."""
        codes, scales = self.quantize(x)
        # Copied as bytes: torch's index operations do not all take float8 tensors.
        self.codes.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
        self.scales.index_copy_(0, slots, scales)
        return self.dequantize(codes, scales, x.dtype)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values at `slots` (any shape S) as [*S, KV heads, head_dim] in dtype."""
        return self.dequantize(self.codes.view(torch.uint8)[slots].view(self.codes.dtype), self.scales[slots], dtype)


def new_cache(kv_cache_dtype: str, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, new_tensor):
    """One layer's K or V cache: a tensor [slots, KV heads, head_dim] in dtype ("auto"), or an 8-bit
    KVCache. new_tensor(shape, dtype) gives a zeroed tensor."""
    if kv_cache_dtype == "auto":
        return new_tensor((slots, kv_heads, head_dim), dtype)
    return KVCache.allocate(kv_cache_dtype, slots, kv_heads, head_dim, new_tensor)


def write(cache, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Stores x at `slots` of a cache in the model's dtype (a tensor) or an 8-bit KVCache; returns the
    values the cache holds for them."""
    if isinstance(cache, KVCache):
        return cache.write(slots, x)
    cache.index_copy_(0, slots, x)
    return x


def read(cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(cache, KVCache):
        return cache.read(slots, dtype)
    return cache[slots]


def kernel_args(k_cache, v_cache, *between) -> tuple:
    """(k data, v data, *between, k scales, v scales) as the CPU kernels take them (scales None for a
    cache in the model's dtype)."""
    if isinstance(k_cache, KVCache):
        return k_cache.codes, v_cache.codes, *between, k_cache.scales, v_cache.scales
    return k_cache, v_cache, *between, None, None
