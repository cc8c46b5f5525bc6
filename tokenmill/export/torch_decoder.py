"""A tokenmill model as plain torch operations over padded batches with a KV cache in Hugging Face's layout,
the graph that export/onnx.py traces.

It reads the model's own description (model/description.py) and weights (float32; quantized ones
dequantized), so every family the decoder supports exports through this one forward. Inputs and outputs are
those of Hugging Face Optimum's decoder exports: input_ids, attention_mask [batch, past + new tokens],
position_ids, and per layer past_key_values.N.key / .value [batch, KV heads, past tokens, head_dim] in;
logits and present.N.key / .value (past and new tokens) out.

LongRoPE picks its factors per sequence of the batch: long where the sequence's largest position + 1 exceeds
original_max_position_embeddings, as transformers' forward does for the pass (model/rotary.py). A
generation loop that grows a sequence past that length must run it again from the start with the long
factors, as transformers' Phi-3 generate() and tokenmill's engine do; the graph cannot re-rotate its cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers import gated
from tokenmill.model.rotary import long_rope_inv_freq, rope_inv_freq, rope_type_of


def dense(module: nn.Module, name: str = "weight") -> torch.Tensor | None:
    """A linear layer's weight (or bias) as a float32 tensor: its parameter (the same storage, where it is
    float32 already: a large model is not held twice), or its quantized parts dequantized."""
    p = getattr(module, name, None)
    if p is not None:
        return p.detach().float()
    if name == "bias":
        return None
    return torch.cat([q.dequantize() for q in module.qparts]).float()


class TorchDecoder(nn.Module):
    """The decoder of a tokenmill model (LlamaForCausalLM or a family built on it) for export."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = self.config = model.config
        self.embed = nn.Parameter(dense(model.embed_tokens), requires_grad=False)
        # None: the output layer is the embedding (tied).
        self.head = None if model.lm_head is None else nn.Parameter(dense(model.lm_head), requires_grad=False)
        self.final_norm = nn.Parameter(model.norm.weight.detach().float(), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(layer, cfg.rotary_dim) for layer in model.layers)
        self.windows = list(cfg.layer_windows)
        self.layer_ropes = list(cfg.layer_ropes)
        for i, spec in enumerate(cfg.ropes):
            inv_freq, attention = rope_inv_freq(cfg.rotary_dim, spec.theta, spec.scaling)
            long = inv_freq
            switch = 0
            if rope_type_of(spec.scaling) == "longrope":
                long = long_rope_inv_freq(cfg.rotary_dim, spec.theta, spec.scaling)
                switch = spec.scaling["original_max_position_embeddings"]
            self.register_buffer(f"inv_freq_{i}", inv_freq, persistent=False)
            self.register_buffer(f"long_inv_freq_{i}", long, persistent=False)
            setattr(self, f"rope_attention_{i}", float(attention))
            setattr(self, f"rope_switch_{i}", switch)
        self.embed_scale = float(torch.tensor(cfg.embed_scale, dtype=torch.float32))

    def _rope(self, i: int, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [batch, 1, tokens, rotary_dim] of rope i at the positions."""
        inv_freq = getattr(self, f"inv_freq_{i}")
        switch = getattr(self, f"rope_switch_{i}")
        if switch:  # per sequence: long factors where it is longer than the switch
            long = (position_ids.max(dim=1, keepdim=True).values + 1 > switch)[..., None]
            inv_freq = torch.where(long, getattr(self, f"long_inv_freq_{i}"), inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        attention = getattr(self, f"rope_attention_{i}")
        return (emb.cos() * attention).unsqueeze(1), (emb.sin() * attention).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(logits [batch, tokens, vocab], then present key and value of each layer)."""
        cfg = self.config
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        new = input_ids.shape[1]
        past_len = past[0].shape[2]
        # Key j is visible to query i (at index past_len + i) if it is not later, not padding, and within the
        # layer's window; indices stand for positions, as sequences are padded on the left.
        q_idx = torch.arange(new, device=x.device)[:, None] + past_len
        k_idx = torch.arange(past_len + new, device=x.device)[None, :]
        visible = (k_idx <= q_idx)[None] & attention_mask[:, None, :].bool()
        masks = {}
        for w in set(self.windows):
            v = visible if w is None else visible & (q_idx - k_idx < w)[None]
            masks[w] = torch.where(v, 0.0, torch.finfo(torch.float32).min)[:, None]
        ropes = [self._rope(i, position_ids) for i in range(len(cfg.ropes))]
        present = []
        for layer, window, rope, k_past, v_past in zip(self.layers, self.windows, self.layer_ropes, past[0::2],
                                                       past[1::2]):
            x, k, v = layer(x, ropes[rope], masks[window], k_past, v_past)
            present += [k, v]
        x = _rms_norm(x, self.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
        logits = x @ (self.embed if self.head is None else self.head).t()
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return (logits, *present)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (offset + w) if offset else normed * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, head_dim: int) -> torch.Tensor:
    rot, half = x[..., :rotary_dim], rotary_dim // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return rotated if rotary_dim == head_dim else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class _Layer(nn.Module):
    """One decoder layer's weights, float32, and its forward over [batch, tokens, hidden]."""

    def __init__(self, layer: nn.Module, rotary_dim: int) -> None:
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.rotary_dim = rotary_dim
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale, self.softcap = a.scale, a.softcap
        self.sandwich = layer.sandwich
        self.moe = _Experts(m) if hasattr(m, "experts") else None

        def param(t: torch.Tensor | None) -> nn.Parameter | None:
            return None if t is None else nn.Parameter(t, requires_grad=False)

        def norm(module: nn.Module | None) -> nn.Parameter | None:
            return None if module is None else param(module.weight.detach().float())

        self.eps, self.offset = layer.input_layernorm.eps, layer.input_layernorm.offset
        self.input_norm = norm(layer.input_layernorm)
        self.qkv, self.qkv_bias = param(dense(a.qkv_proj)), param(dense(a.qkv_proj, "bias"))
        self.q_norm, self.k_norm = norm(a.q_norm), norm(a.k_norm)
        self.o, self.o_bias = param(dense(a.o_proj)), param(dense(a.o_proj, "bias"))
        self.post_attention_norm = norm(layer.post_attention_layernorm)
        self.pre_ffn_norm = norm(getattr(layer, "pre_feedforward_layernorm", None))
        self.post_ffn_norm = norm(getattr(layer, "post_feedforward_layernorm", None))
        self.sinks = param(None if a.sinks is None else a.sinks.detach().float())
        if self.moe is None:
            self.activation, self.intermediate = m.activation, m.intermediate
            self.gate_up, self.gate_up_bias = param(dense(m.gate_up_proj)), param(dense(m.gate_up_proj, "bias"))
            self.down, self.down_bias = param(dense(m.down_proj)), param(dense(m.down_proj, "bias"))

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, w, self.eps, self.offset)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = x @ w.t()
        return y if b is None else y + b

    def forward(self, x, rope, mask, k_past, v_past):
        b, n, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._linear(self._norm(x, self.input_norm), self.qkv, self.qkv_bias)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)
        k = k.view(b, n, kvh, d).transpose(1, 2)
        v = v.view(b, n, kvh, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        cos, sin = rope
        q, k = _rotate(q, cos, sin, self.rotary_dim, d), _rotate(k, cos, sin, self.rotary_dim, d)
        k = torch.cat((k_past, k), dim=2)
        v = torch.cat((v_past, v), dim=2)
        total = k.shape[2]
        # Grouped-query attention: each KV head serves h // kvh query heads.
        kk = k[:, :, None].expand(b, kvh, h // kvh, total, d).reshape(b, h, total, d)
        vv = v[:, :, None].expand(b, kvh, h // kvh, total, d).reshape(b, h, total, d)
        scores = (q @ kk.transpose(2, 3)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + mask
        if self.sinks is not None:  # each head's sink logit joins its softmax's denominator, then goes
            sink = self.sinks[None, :, None, None].expand(b, h, n, 1)
            attn = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1] @ vv
        else:
            attn = torch.softmax(scores, dim=-1) @ vv
        out = self._linear(attn.transpose(1, 2).reshape(b, n, h * d), self.o, self.o_bias)
        if self.sandwich:
            x = x + self._norm(out, self.post_attention_norm)
            mlp_in = self._norm(x, self.pre_ffn_norm)
        else:
            x = x + out
            mlp_in = self._norm(x, self.post_attention_norm)
        if self.moe is not None:
            mlp = self.moe(mlp_in)
        else:
            gate, up = self._linear(mlp_in, self.gate_up, self.gate_up_bias).split(self.intermediate, dim=-1)
            mlp = self._linear(gated(gate, up, self.activation), self.down, self.down_bias)
        x = x + (self._norm(mlp, self.post_ffn_norm) if self.sandwich else mlp)
        return x, k, v


class _Experts(nn.Module):
    """A mixture-of-experts feed-forward (model/moe.py's SparseMoE), float32, as plain tensor operations: the
    router's top k by the model's own rule, every expert over every token in one product per weight (a
    graph has no data-dependent loop), and each token's output the sum of its experts' outputs weighted by
    its routing weights (zero for the experts it did not pick); Qwen2-MoE's gated shared expert added."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        spec, experts = moe.spec, moe.experts
        self.top_k, self.norm_topk_prob, self.softmax_after_topk = spec.top_k, spec.norm_topk_prob, spec.softmax_after_topk
        self.intermediate, self.activation, self.glu = experts.intermediate, experts.activation, experts.glu

        def param(t: torch.Tensor | None) -> nn.Parameter | None:
            return None if t is None else nn.Parameter(t.detach().float(), requires_grad=False)

        self.router, self.router_bias = param(dense(moe.gate)), param(dense(moe.gate, "bias"))
        if experts.quantized:
            raise ValueError("the export takes experts loaded as float weights (quantization='none')")
        self.gate_up, self.down = param(experts.gate_up_proj), param(experts.down_proj)  # [E, 2I, H], [E, H, I]
        self.gate_up_bias, self.down_bias = param(experts.gate_up_bias), param(experts.down_bias)
        shared = moe.shared_expert
        self.shared = None
        if shared is not None:
            self.shared = nn.ParameterList([param(dense(shared.gate_up_proj)), param(dense(shared.down_proj)),
                                            param(dense(moe.shared_expert_gate))])
            self.shared_intermediate = shared.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.router.t()
        if self.router_bias is not None:
            logits = logits + self.router_bias
        if self.softmax_after_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        every = torch.zeros(*logits.shape, dtype=x.dtype).scatter(-1, ids, weights)  # [b, n, E]
        gate_up = torch.einsum("bnh,eih->bnei", x, self.gate_up)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        gate, up = gate_up.split(self.intermediate, dim=-1)
        out = torch.einsum("bnei,ehi->bneh", gated(gate, up, self.activation, self.glu), self.down)
        if self.down_bias is not None:
            out = out + self.down_bias
        y = torch.einsum("bneh,bne->bnh", out, every)
        if self.shared is not None:
            gate_up_w, down_w, gate_w = self.shared
            gate, up = (x @ gate_up_w.t()).split(self.shared_intermediate, dim=-1)
            y = y + torch.sigmoid(x @ gate_w.t()) * (gated(gate, up, self.activation, self.glu) @ down_w.t())
        return y
