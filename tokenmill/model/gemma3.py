"""Gemma 3 (text): Gemma 2's description with an RMSNorm over each query and key head, and two ropes.

Local (sliding-window) layers take rope_local_base_freq, global ones rope_theta and rope_scaling; without
layer_types, every sixth layer is global. As in transformers' Gemma 3, attention logits are not
soft-capped (its configs leave attn_logit_softcapping None); the final logits are where the config says.
"""

from __future__ import annotations

import logging

from tokenmill.model.description import RopeSpec
from tokenmill.model.gemma2 import Gemma2ForCausalLM

logger = logging.getLogger("tokenmill")


def _rope_specs(c: dict) -> tuple[RopeSpec, RopeSpec]:
    """(global, local) ropes: from rope_parameters per layer type (transformers 5), else from rope_theta,
    rope_scaling and rope_local_base_freq (the released configs)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
        def spec(p: dict | None, theta: float) -> RopeSpec:
            p = p or {}
            return RopeSpec(p.get("rope_theta", theta), p if p.get("rope_type", "default") != "default" else None)
        return (spec(params.get("full_attention"), c["rope_theta"]),
                spec(params.get("sliding_attention"), c["rope_local_base_freq"]))
    return RopeSpec(c["rope_theta"], c.get("rope_scaling")), RopeSpec(c["rope_local_base_freq"], None)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    defaults = {**Gemma2ForCausalLM.defaults, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                "attn_logit_softcapping": None, "final_logit_softcapping": None}
    window_pattern = 6

    @classmethod
    def switches(cls, c: dict) -> dict:
        """Gemma 2's fields, with q/k norms, a rope per layer kind and no attention softcap."""
        if c.get("attn_logit_softcapping") is not None:
            logger.info("Gemma 3 ignores attn_logit_softcapping=%s, as transformers' Gemma 3 does",
                        c["attn_logit_softcapping"])
        global_rope, local_rope = _rope_specs(c)
        return {**super().switches(c), "qk_norm": True, "attn_softcap": None, "ropes": [global_rope, local_rope],
                "layer_ropes": [1 if t == "sliding_attention" else 0 for t in c["layer_types"]]}
