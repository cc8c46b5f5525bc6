"""Mistral: the Llama decoder with an optional sliding attention window (read from its config)."""

from tokenmill.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    # transformers' Mistral applies its one window to every layer, whatever layer_types a config carries.
    per_layer_windows = False
