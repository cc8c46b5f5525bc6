"""Mistral: the Llama decoder with an optional sliding attention window (read from its config)."""

from tokenmill.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
