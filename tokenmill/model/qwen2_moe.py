"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (q/k/v biases where the config's qkv_bias says) with
mixture-of-experts feed-forwards and a shared expert.

Every token also runs the shared expert (shared_expert_intermediate_size), its output scaled by
sigmoid(x . shared_expert_gate) before it joins the routed experts'. Routing as Qwen3-MoE's (qwen3_moe.py).
"""

from __future__ import annotations

from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    defaults = {**Qwen3MoeForCausalLM.defaults, "qkv_bias": True}

    @classmethod
    def qkv_bias_of(cls, c: dict) -> bool:
        return bool(c["qkv_bias"])
