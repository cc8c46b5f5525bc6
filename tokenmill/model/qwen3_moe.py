"""Qwen3-MoE: Qwen3's decoder (q/k norms) with mixture-of-experts feed-forwards.

Routing: softmax over all experts, top k, renormalised only where the config sets norm_topk_prob. Layers in
mlp_only_layers, or off every decoder_sparse_step-th, keep a dense MLP of intermediate_size.
"""

from __future__ import annotations

from tokenmill.model.description import DecoderConfig, MoESpec
from tokenmill.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # What transformers' config class assumes for keys a config.json leaves out.
    defaults = {"norm_topk_prob": False, "decoder_sparse_step": 1, "hidden_act": "silu"}

    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """The description of a Qwen-MoE model, from its HF config dict."""
        c = {**cls.defaults, **hf_config}
        if c["hidden_act"] != "silu":
            raise ValueError(f"{cls.__name__} activation {c['hidden_act']!r} is not supported (supported: silu)")
        return DecoderConfig.from_hf(c, qkv_bias=cls.qkv_bias_of(c), qk_norm=cls.qk_norm,
                                     per_layer_windows=cls.per_layer_windows, moe=MoESpec.from_hf(c))

    @classmethod
    def qkv_bias_of(cls, c: dict) -> bool | None:
        """Whether q, k and v carry biases (None: the config's attention_bias)."""
        return cls.qkv_bias
