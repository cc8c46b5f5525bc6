"""Mixtral: Mistral's decoder (one sliding window for every layer, if any) with a mixture of experts in every
layer.

Each token's experts weigh by a softmax over its top-k router logits (computed as transformers does: a
softmax over all, the top k renormalised), the weights kept in float32. The checkpoints name the experts'
gate, down and up projections w1, w2 and w3 under block_sparse_moe; they load into the shared modules'
names (mlp.experts.<e>.gate_proj, ...).
"""

from __future__ import annotations

import re

from tokenmill.model.description import DecoderConfig, MoESpec
from tokenmill.model.mistral import MistralForCausalLM

_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """The description of a Mixtral model, from its HF config dict."""
        c = hf_config
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Mixtral activation {c['hidden_act']!r} is not supported (supported: silu)")
        moe = MoESpec.from_hf(c, intermediate_size=c["intermediate_size"],
                              norm_topk_prob=True, sparse_layers=[True] * c["num_hidden_layers"],
                              shared_intermediate_size=0, weights_in_float=True)
        return DecoderConfig.from_hf(c, qkv_bias=False, per_layer_windows=False, moe=moe)

    def canonical_name(self, name: str) -> str:
        name = _EXPERT.sub(lambda m: f"mlp.experts.{m.group(1)}.{_W[m.group(2)]}.", name)
        return name.replace("block_sparse_moe.", "mlp.")
