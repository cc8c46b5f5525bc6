"""Phi-3, Phi-3.5 and Phi-4-mini (Phi3ForCausalLM): the Llama decoder as their checkpoints describe it.

The checkpoints hold q/k/v as one qkv_proj and gate/up as one gate_up_proj, which load straight into the
decoder's merged layers. Long-context variants scale rope with LongRoPE (short and long factors, an attention
factor; rotary.py says which tokens take which), Phi-4-mini rotates only the first partial_rotary_factor of
each head, and Phi-3-mini's configs carry a sliding window for every layer.
"""

from __future__ import annotations

from tokenmill.model.description import DecoderConfig
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.rotary import rope_type_of


class Phi3ForCausalLM(LlamaForCausalLM):
    # What transformers' Phi3Config assumes for keys a config.json leaves out.
    defaults = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                "hidden_act": "silu", "rope_theta": 10_000.0}

    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """The description of a Phi-3 model, from its HF config dict."""
        c = {**cls.defaults, **hf_config}
        if c["hidden_act"] != "silu":
            raise ValueError(f"Phi3 activation {c['hidden_act']!r} is not supported (supported: silu)")
        for key in ("rope_scaling", "rope_parameters"):
            scaling = c.get(key)
            # transformers' Phi3Config reads the older names "su" and "yarn" as LongRoPE.
            if isinstance(scaling, dict) and rope_type_of(scaling) in ("su", "yarn"):
                c[key] = {**scaling, "rope_type": "longrope"}
        return DecoderConfig.from_hf(c, qkv_bias=False)
