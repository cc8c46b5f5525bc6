"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, and the experts run grouped.

Grouped: a step's (token, expert) pairs are sorted by expert, and each expert with at least one token
multiplies all of its tokens' rows at once: one product per active expert and weight matrix, whatever the
number of tokens (the Python loop is over experts, never over tokens). A decode step of many requests thus
reads each chosen expert's weights once. The weighted outputs are scattered back onto their tokens with
one index_add.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenmill.kernels.cpu import linear
from tokenmill.kernels.quant import float_from
from tokenmill.model.description import MoESpec
from tokenmill.model.layers import GatedMLP, Linear, gated

# An expert's weight (or bias) in Hugging Face naming: "<...>.experts.<e>.gate_proj.weight" one expert at a
# time, or "<...>.experts.gate_proj.weight" for all experts stacked [E, rows, cols] (GGUF's ffn_*_exps
# tensors; their biases [E, rows]).
EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj)\.(weight|bias)$")
PARTS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """num_experts gated experts stacked: float gate_up_proj [E, 2I, H] (an expert's gate rows then its up rows,
    one product for both) and down_proj [E, H, I]; or, from a GGUF file, any of gate, up and down as one
    quantized matrix [E * rows, cols] in its block format, each expert's slice (a view) multiplied by that
    format's kernel. Quantized gate and up stay two matrices (two products an expert): the file holds them
    apart, and interleaving them per expert would copy them. With `bias` (gpt-oss), each expert's projections
    add biases, gate_up_bias [E, 2I] (gate then up) and down_bias [E, H], in the model's dtype whatever the
    weights' format."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str, bias: bool = False,
                 glu: tuple[float, float] = (1.0, 0.0)) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.activation, self.glu = activation, glu
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self._whole: list = [None, None, None]  # per part (gate, up, down): the stacked QuantizedWeight
        self._slices: list = [None, None, None]  # per part: each expert's QuantizedWeight (views of the whole)
        self._quantized: set[int] = set()

    def _shape(self, part: int) -> tuple[int, int]:
        """One expert's [rows, cols] of a part."""
        return (self.hidden, self.intermediate) if part == 2 else (self.intermediate, self.hidden)

    # ------------------------------------------------------------------ weights
    def quantize_part(self, part: int) -> None:
        """Before materialization: part (0 gate, 1 up, 2 down) will arrive quantized; its float copy goes
        (gate and up share theirs, so both then arrive quantized)."""
        self.register_parameter("down_proj" if part == 2 else "gate_up_proj", None)
        self._quantized.add(part)

    @property
    def quantized(self) -> bool:
        return bool(self._quantized)

    @property
    def qparts(self) -> list:
        """The quantized matrices held (for the loader's accounting): each part stacked, or its experts'."""
        return [w for whole, slices in zip(self._whole, self._slices)
                for w in ([whole] if whole is not None else slices or ()) if w is not None]

    def checkpoint_names(self, prefix: str, parts=range(3), experts=None, kinds=None) -> list[str]:
        """Hugging Face names of the weights (and biases, where the experts have them) of `parts` of `experts`
        (default all), under module name prefix."""
        experts = range(self.num_experts) if experts is None else experts
        kinds = kinds or (("weight", "bias") if self.gate_up_bias is not None else ("weight",))
        return [f"{prefix}.{e}.{PARTS[p]}.{kind}" for kind in kinds for p in parts for e in experts]

    def load_bias(self, part: int, tensor: torch.Tensor, expert: int | None) -> None:
        """One expert's bias of a part [rows], or (expert None) all experts' [E, rows]."""
        rows = self._shape(part)[0]
        if self.gate_up_bias is None:
            raise ValueError("these experts have no biases")
        expected = (rows,) if expert is not None else (self.num_experts, rows)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"expert bias has shape {tuple(tensor.shape)}, expected {expected}")
        target = self.down_bias if part == 2 else self.gate_up_bias[:, part * rows:(part + 1) * rows]
        with torch.no_grad():
            (target if expert is None else target[expert]).copy_(tensor)

    def load(self, part: int, tensor, expert: int | None) -> None:
        """One expert's matrix of a part, or (expert None) all experts' stacked: float [rows, cols] or
        [E, rows, cols], or a QuantizedWeight [rows, cols] (quantized at load) or [E * rows, cols] (a file's
        stacked blocks)."""
        rows, cols = self._shape(part)
        if not isinstance(tensor, torch.Tensor):
            if part not in self._quantized:
                raise ValueError(f"quantized expert weights ({PARTS[part]}) must go to a part prepared for them")
            if expert is not None:
                if tensor.shape != (rows, cols):
                    raise ValueError(f"expert {expert}'s {PARTS[part]} has shape {tensor.shape}, expected {(rows, cols)}")
                if self._slices[part] is None:
                    self._slices[part] = [None] * self.num_experts
                self._slices[part][expert] = tensor
                return
            if tensor.shape != (self.num_experts * rows, cols):
                raise ValueError(f"stacked expert tensor has shape {tensor.shape}, expected "
                                 f"{(self.num_experts * rows, cols)}")
            from tokenmill.kernels.quant import QuantizedWeight

            self._whole[part] = tensor
            self._slices[part] = [QuantizedWeight(tensor.qtype, (rows, cols), tensor.data[e * rows:(e + 1) * rows])
                                  for e in range(self.num_experts)]
            return
        if part in self._quantized:
            raise ValueError(f"expert part {PARTS[part]} was prepared for quantized weights, got a float tensor")
        expected = (rows, cols) if expert is not None else (self.num_experts, rows, cols)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"expert tensor has shape {tuple(tensor.shape)}, expected {expected}")
        target = self.down_proj if part == 2 else self.gate_up_proj[:, part * rows:(part + 1) * rows]
        with torch.no_grad():
            (target if expert is None else target[expert]).copy_(tensor)

    def fused_parts(self, e: int) -> tuple[list, list]:
        """Expert e's gate_up (gate rows, then up rows) and down as the fused decoder takes them: (tensor,
        GGML type id) per row range, views of the weights held here."""
        def dense(w: torch.Tensor) -> tuple[torch.Tensor, int]:
            w = w.detach()
            return w, 30 if w.dtype == torch.bfloat16 else 0

        if self._slices[0] is None:
            gate_up = [dense(self.gate_up_proj[e])]
        else:
            gate_up = [(self._slices[p][e].data, self._slices[p][e].qtype) for p in (0, 1)]
        down = [dense(self.down_proj[e])] if self._slices[2] is None else \
            [(self._slices[2][e].data, self._slices[2][e].qtype)]
        return gate_up, down

    # ------------------------------------------------------------------ compute
    def expert(self, e: int, x: torch.Tensor, float_from: int | None = None) -> torch.Tensor:
        """Expert e over rows x [n, H] -> [n, H]: one product per weight matrix for all n rows (block-format
        products take float inputs from row float_from on: a prompt's rows)."""
        gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        down_bias = None if self.down_bias is None else self.down_bias[e]
        if self._slices[0] is None:
            gate, up = linear(x, self.gate_up_proj[e], gate_up_bias).split(self.intermediate, dim=-1)
        else:
            gate, up = self._slices[0][e].matmul(x, float_from), self._slices[1][e].matmul(x, float_from)
            if gate_up_bias is not None:
                gate, up = gate + gate_up_bias[:self.intermediate], up + gate_up_bias[self.intermediate:]
        h = gated(gate, up, self.activation, self.glu)
        if self._slices[2] is None:
            return linear(h, self.down_proj[e], down_bias)
        y = self._slices[2][e].matmul(h, float_from)
        return y if down_bias is None else y + down_bias

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> [T, H]: sum over j of weights[t, j] * expert ids[t, j] (x[t])."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each group in token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k
        rows = x.index_select(0, token)
        out = torch.empty_like(rows)
        # Where the step's last rows are a prompt's (float_from): each expert's rows are in token order, so
        # its rows of the tokens before those come first.
        first = float_from(x.shape[0])
        before = None if first is None else torch.bincount(flat[:first * k], minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self.expert(e, rows[start:start + n], None if before is None else before[e])
                start += n
        scaled = out * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, scaled.to(x.dtype))


class SparseMoE(nn.Module):
    """A layer's mixture-of-experts feed-forward: router (gate), experts, and Qwen2-MoE's shared expert."""

    def __init__(self, hidden: int, spec: MoESpec, activation: str, glu: tuple[float, float] = (1.0, 0.0)) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(hidden, spec.num_experts, bias=spec.router_bias)  # the router
        self.gate.keep_float = True  # its top-k choice is discrete: quantizing at load could flip it
        self.experts = Experts(spec.num_experts, hidden, spec.intermediate_size, activation, spec.expert_bias, glu)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, spec.shared_intermediate_size, False, activation)
            self.shared_expert_gate = Linear(hidden, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, [T, k] each: softmax (float32) over all the router's
        logits, top k, renormalised where the description says (spec.norm_topk_prob); or (gpt-oss) the top
        k logits, then a softmax over them."""
        logits = self.gate(x)
        if self.spec.softmax_after_topk:
            top, ids = torch.topk(logits, self.spec.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
            return ids, weights if self.spec.weights_in_float else weights.to(logits.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.spec.weights_in_float else weights.to(logits.dtype)

    def add_to_fused(self, fused) -> None:
        """Hands this layer's router, experts and shared expert to the fused decoder (set_experts), for the
        layer just added there without a dense MLP."""
        spec, experts = self.spec, self.experts
        gate_up, down = zip(*(experts.fused_parts(e) for e in range(spec.num_experts)))
        shared = {}
        if self.shared_expert is not None:
            shared = dict(shared_gate_up=self.shared_expert.gate_up_proj.fused_parts(),
                          shared_down=self.shared_expert.down_proj.fused_parts(),
                          shared_gate=self.shared_expert_gate.fused_parts(),
                          shared_intermediate=spec.shared_intermediate_size)
        bias = lambda p: None if p is None else p.detach()  # noqa: E731
        fused.set_experts(self.gate.fused_parts(), list(gate_up), list(down), spec.intermediate_size, spec.top_k,
                          spec.norm_topk_prob, spec.weights_in_float, **shared,
                          softmax_after_topk=spec.softmax_after_topk, router_bias=bias(self.gate.bias),
                          gate_up_bias=bias(experts.gate_up_bias), down_bias=bias(experts.down_bias))

    sum_group = None  # tensor parallel: each rank's experts hold a slice of every expert (distributed/)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        if self.sum_group is not None:
            # Every rank must pick the same experts: a near-tie in the router's logits could round the other
            # way on a rank whose product ran on another number of threads, and its slices would then add to
            # other experts' slices. Rank 0's choice goes to all (ids are exact in float32).
            k = ids.shape[-1]
            chosen = self.sum_group.all_gather(torch.cat([ids.float(), weights.float()], dim=-1))[0]
            ids, weights = chosen[:, :k].long(), chosen[:, k:].to(weights.dtype)
        y = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y if self.sum_group is None else self.sum_group.all_reduce(y)
