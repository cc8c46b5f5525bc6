"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections."""

from tokenmill.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
