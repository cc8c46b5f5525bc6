"""Building blocks shared by the decoder models: norm, MLP, fused linear layers (rotary embeddings: rotary.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu import chunk_ops, linear
from tokenmill.kernels.quant import float_from
from tokenmill.model.description import ACTIVATIONS


class RMSNorm(nn.Module):
    """RMSNorm scaling by (offset + weight): offset 0 as Llama, 1 as Gemma (description.py); in_float: the
    scale applies in float32 whatever the offset (gpt-oss)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, in_float: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.in_float = in_float or offset != 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementations do. Llama's scale applies in the model
        # dtype to the rounded value; Gemma's (1 + w) and gpt-oss's w in float32, rounded once at the end.
        ops = chunk_ops(x)
        if ops is not None and self.weight.dtype == torch.bfloat16 and x.dim() and x.shape[-1] % 16 == 0:
            # (q and k norms take views of the qkv rows: copied first, as torch's float32 copy copies them)
            return ops.rms_norm_bf16(x.contiguous(), self.weight.detach(), self.eps, self.offset, self.in_float)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.in_float:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping), or x where cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class _QuantizableLinear(nn.Module):
    """The weight-format seam of the linear layers: a float weight (a parameter), or a QuantizedWeight
    whose kernel computes the product in its own format (kernels/quant.py). quantize_weight() on the
    meta-device model drops the float parameter before any memory is allocated for it; the loader then
    hands over the quantized matrix, in parts for merged projections."""

    in_features: int
    out_sizes: list[int]
    qweight = None  # QuantizedWeight, or a list of them (one per part) where the parts' formats differ
    _qparts: list | None = None  # the parts as they arrive; None: a float layer
    # A tensor-parallel row-parallel layer (distributed/): each rank's product is a partial sum, added up
    # over this group's ranks (the bias is on rank 0 alone).
    sum_group = None

    def quantize_weight(self) -> None:
        self.register_parameter("weight", None)
        self._qparts = [None] * len(self.out_sizes)

    @property
    def quantized(self) -> bool:
        return self._qparts is not None

    @property
    def qparts(self) -> list:
        """The quantized matrices this layer holds (none for a float layer)."""
        q = self.qweight
        return q if isinstance(q, list) else [] if q is None else [q]

    @property
    def missing_parts(self) -> bool:
        return self._qparts is not None and any(p is None for p in self._qparts)

    def fused_parts(self) -> list[tuple[torch.Tensor, int]]:
        """The weight as the fused decoder takes it: (tensor, GGML type id) per row range, in order; a
        float weight is one dense part (type 0 float32, 30 bfloat16)."""
        if self.qweight is None:
            w = self.weight.detach()
            return [(w, 30 if w.dtype == torch.bfloat16 else 0)]
        return [(p.data, p.qtype) for p in self.qparts]

    def load_quantized(self, index: int, qweight) -> None:
        if len(self.out_sizes) > 1 and qweight.shape == (sum(self.out_sizes), self.in_features):
            self._qparts = [qweight]  # a merged projection stored whole (Phi-3's attn_qkv, ffn_up)
            self.qweight = qweight
            return
        if qweight.shape != (self.out_sizes[index], self.in_features):
            raise ValueError(f"checkpoint tensor has shape {qweight.shape}, expected "
                             f"{(self.out_sizes[index], self.in_features)}")
        self._qparts[index] = qweight
        if not self.missing_parts:
            parts = self._qparts
            same = all(type(p) is type(parts[0]) and p.qtype == parts[0].qtype for p in parts)
            self.qweight = (parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)) if same else list(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qweight
        if q is None:
            y = linear(x, self.weight, self.bias)
        else:
            f = float_from(x.numel() // x.shape[-1])  # a prompt's rows of the running step
            y = torch.cat([p.matmul(x, f) for p in q], dim=-1) if isinstance(q, list) else q.matmul(x, f)
            y = y if self.bias is None else y + self.bias
        return y if self.sum_group is None else self.sum_group.all_reduce(y)


class MergedLinear(_QuantizableLinear):
    """Several linear projections of the same input stored as one matrix (fewer, larger matmuls).

    load_shard() fills one part from a checkpoint tensor, float or quantized."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_sizes))) if bias else None

    def load_shard(self, index: int, tensor, is_bias: bool = False) -> None:
        if not isinstance(tensor, torch.Tensor):
            return self.load_quantized(index, tensor)
        start = sum(self.out_sizes[:index])
        target = self.bias if is_bias else self.weight
        expected = (self.out_sizes[index],) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            target[start:start + self.out_sizes[index]].copy_(tensor)


class Linear(_QuantizableLinear):
    """A linear layer whose small-batch bf16 products go through the decode kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_sizes = [out_features]
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None


def takes_blocks(module: nn.Module) -> bool:
    """Whether quantization at load (int8 / int4) gives this module 32-element blocks: a linear layer or
    embedding whose rows divide into groups of 32, unless it must stay float (a router's keep_float)."""
    return (isinstance(module, _QuantizableLinear) and module.in_features % 32 == 0
            and not getattr(module, "keep_float", False))


class Embedding(_QuantizableLinear):
    """Token embedding: a [vocab, hidden] table, float or quantized (the looked-up rows are then
    dequantized), which serves as the output layer where the two are tied."""

    # A tensor-parallel shard's table holds rows [vocab_start, vocab_start + num_embeddings) of a vocabulary
    # of `vocab` (shard_of); a token's row then comes from the rank holding it, summed over `group`.
    vocab_start, vocab, group = 0, None, None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.in_features, self.out_sizes = embedding_dim, [num_embeddings]
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.bias = None

    def shard_of(self, vocab_start: int, vocab: int, group) -> None:
        self.vocab_start, self.vocab, self.group = vocab_start, vocab, group

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.group is not None:
            local = ids - self.vocab_start
            inside = (local >= 0) & (local < self.num_embeddings)
            rows = self._rows(torch.where(inside, local, torch.zeros_like(local)), dtype)
            return self.group.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))
        return self._rows(ids, dtype)

    def _rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.dequantize(ids).view(*ids.shape, self.embedding_dim).to(dtype)
        return F.embedding(ids, self.weight)

    def as_output(self, x: torch.Tensor) -> torch.Tensor:
        """x @ table^T: logits through a tied output layer."""
        return super().forward(x)


class GatedMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), gate and up fused; act silu (SwiGLU), the
    tanh-approximated GELU (GeGLU), or the clamped SwiGLU (`glu`: its alpha and limit)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu",
                 glu: tuple[float, float] = (1.0, 0.0)) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate
        self.activation = activation
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        ops = chunk_ops(gu)
        if ops is not None and gu.dim() == 2 and gu.is_contiguous() and self.intermediate % 16 == 0:
            return self.down_proj(ops.glu_bf16(gu, ACTIVATIONS.index(self.activation), *self.glu))
        gate, up = gu.split(self.intermediate, dim=-1)
        return self.down_proj(gated(gate, up, self.activation, self.glu))


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str, glu: tuple[float, float] = (1.0, 0.0)) -> torch.Tensor:
    """act(gate) * up: act silu (SwiGLU) or the tanh-approximated GELU (GeGLU); or gpt-oss's clamped SwiGLU,
    glu = (alpha, limit): gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in that reference's order of operations."""
    if activation == "clamped_swiglu":
        alpha, limit = glu
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up
