"""A decoder-only architecture described as data: sizes, and the switches in which the supported families
differ (norm kind, activation, extra norms, rope and window per layer, partial rotary, softcaps, embedding
scale, attention sinks, mixture-of-experts routing).

The module-by-module decoder (llama.py) and the fused CPU decode step (kernels/cpu_kernels.cpp) both read
this one description, so a new family is a new way of filling it in, not a new decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.model.rotary import rope_type_of

# The gate's activation: SwiGLU, GeGLU (tanh-approximated GELU), and gpt-oss's clamped SwiGLU (glu_alpha,
# glu_limit: gate clamped above, up on both sides, (up + 1) * gate * sigmoid(alpha * gate)).
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


@dataclass(slots=True)
class RopeSpec:
    """One rotary embedding: its base and its scaling (an HF rope_scaling dict, or None)."""

    theta: float
    scaling: dict | None = None


@dataclass(slots=True)
class MoESpec:
    """A mixture-of-experts feed-forward: each token's `top_k` of `num_experts` gated experts, weighted.

    Routing: a softmax over all the router's logits, the top k taken, renormalised to sum to 1 where
    norm_topk_prob (Mixtral always: a softmax over its top-k logits; Qwen2-MoE / Qwen3-MoE as configured).
    A layer is sparse where sparse_layers says so, else a dense MLP of the config's intermediate_size."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    sparse_layers: list[bool]
    shared_intermediate_size: int = 0  # Qwen2-MoE: one shared expert on every token, gated by sigmoid(x . w)
    weights_in_float: bool = False  # the routing weights scale the experts' outputs in float32 (Mixtral)
    # gpt-oss: the router has a bias; each token's top k router logits, then a softmax over those k alone
    # (in the logits' dtype); every expert's projections have biases.
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"experts per token must be in [1, num_experts={self.num_experts}], got {self.top_k}")

    @classmethod
    def from_hf(cls, c: dict, **fields) -> "MoESpec":
        """The Qwen-MoE reading of an HF config: a layer is sparse unless listed in mlp_only_layers or off
        the decoder_sparse_step; `fields` override (Mixtral's rules)."""
        n, step, dense = c["num_hidden_layers"], c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or ())
        # Qwen's configs say num_experts, Mixtral's num_local_experts (transformers 5 saves Qwen's under both names).
        num_experts = c.get("num_experts") or c.get("num_local_experts") or 0
        values = dict(num_experts=num_experts, top_k=c["num_experts_per_tok"],
                      intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
                      norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                      sparse_layers=[num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)],
                      shared_intermediate_size=c.get("shared_expert_intermediate_size") or 0)
        return cls(**{**values, **fields})


@dataclass(slots=True)
class DecoderConfig:
    """The hyper-parameters and architecture switches the decoder needs, read from an HF config dict.

    The switches default to Llama's; each family's model class sets its own (see `describe`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: list[int | None]  # per layer: the sliding attention window, or None for full attention
    # RMSNorm scales by (norm_offset + w). 0: Llama (w applied in the model dtype after the normalised value
    # is rounded); 1: Gemma (1 + w applied in float32, one rounding at the end), as each reference computes it.
    norm_offset: float = 0.0
    activation: str = "silu"
    # Gemma's "sandwich": the attention and MLP outputs are normed before they join the residual stream
    # (post_attention_layernorm on the attention output, pre_/post_feedforward_layernorm around the MLP).
    sandwich_norms: bool = False
    attn_scale: float | None = None  # the attention logits' scale; None: head_dim ** -0.5
    embed_scale: float = 1.0  # embeddings are multiplied by this, rounded to the model dtype (Gemma: sqrt(hidden))
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_softcap: float | None = None  # output logits -> cap * tanh(logits / cap)
    ropes: list[RopeSpec] = field(default_factory=list)  # the distinct rotary embeddings; [] : one from rope_theta
    layer_ropes: list[int] = field(default_factory=list)  # per layer: its index in ropes; [] : all 0
    rotary_dim: int | None = None  # the leading dims of each head that rotate (partial rotary); None: head_dim
    moe: MoESpec | None = None  # the feed-forward as a mixture of experts (its sparse layers); None: dense
    # gpt-oss: a learned logit per query head that joins each softmax's denominator (an "attention sink":
    # probability mass that goes to no token).
    attn_sinks: bool = False
    # With norm_offset 0: the weight scales the float32 normalised value, rounded once (gpt-oss), instead of
    # the rounded value in the model dtype (Llama).
    norm_weight_in_float: bool = False
    glu_alpha: float = 1.0  # clamped_swiglu's sigmoid gain and clamp
    glu_limit: float = 0.0

    def __post_init__(self) -> None:
        if self.attn_scale is None:
            self.attn_scale = self.head_dim ** -0.5
        if not self.ropes:
            self.ropes = [RopeSpec(self.rope_theta, self.rope_scaling)]
        if not self.layer_ropes:
            self.layer_ropes = [0] * self.num_layers
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.activation == "clamped_swiglu" and not self.glu_limit > 0:
            raise ValueError(f"the clamped SwiGLU needs a positive limit, got {self.glu_limit}")
        if len(self.layer_ropes) != self.num_layers or not all(0 <= i < len(self.ropes) for i in self.layer_ropes):
            raise ValueError(f"layer_ropes must name one of the {len(self.ropes)} rotary embeddings per layer")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(f"the experts' sparse_layers lists {len(self.moe.sparse_layers)} layers, "
                             f"the model has {self.num_layers}")

    @classmethod
    def from_hf(cls, c: dict, *, qkv_bias: bool | None = None, qk_norm: bool = False,
                per_layer_windows: bool = True, **switches) -> "DecoderConfig":
        """The Llama-family reading of an HF config; `switches` set the architecture fields above."""
        heads = c["num_attention_heads"]
        attention_bias = bool(c.get("attention_bias", False))
        rope_scaling = c.get("rope_scaling")
        rope_theta = c.get("rope_theta")
        # Newer configs keep rope settings under rope_parameters.
        params = c.get("rope_parameters")
        partial = c.get("partial_rotary_factor", 1.0)
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            partial = params.get("partial_rotary_factor", partial)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_type_of(rope_scaling) in ("longrope", "su"):
            rope_scaling = longrope_scaling(rope_scaling, c)
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        switches.setdefault("rotary_dim", int(head_dim * partial))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=qk_norm,
            layer_windows=layer_windows(c, per_layer_windows),
            **switches,
        )


def longrope_scaling(scaling: dict, c: dict) -> dict:
    """A LongRoPE scaling dict completed as transformers completes it: original_max_position_embeddings from
    the config's top level where it is there (else the dict's, else max_position_embeddings); factor
    max_position_embeddings / original where not given; attention_factor sqrt(1 + ln(factor) / ln(original))
    where not given (1 for factors up to 1)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"LongRoPE rope scaling needs a {key} list, got {scaling.get(key)!r}")
    original = (c.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                or c.get("max_position_embeddings", 4096))
    factor = scaling.get("factor") or c.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": int(original),
            "factor": factor, "attention_factor": attention}


def layer_windows(c: dict, per_layer: bool = True) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from an HF config dict, by transformers' rules:
    `layer_types` where present; else, with `max_window_layers` (Qwen2/Qwen3), the window only from that
    layer on; else one window for every layer (Mistral). per_layer=False ignores both, as transformers'
    Mistral does."""
    n = c["num_hidden_layers"]
    window = (c.get("sliding_window") if c.get("use_sliding_window", True) else None) or None
    types = c.get("layer_types") if per_layer else None
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {n}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported by this decoder; "
                             "expected sliding_attention or full_attention")
        return [window if t == "sliding_attention" else None for t in types]
    first = c.get("max_window_layers") if per_layer else None
    if first is not None:
        return [window if i >= first else None for i in range(n)]
    return [window] * n
