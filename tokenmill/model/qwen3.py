"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before rotary."""

from tokenmill.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
