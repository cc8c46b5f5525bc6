"""Gemma 2: the Llama decoder described with Gemma's switches.

(1 + w) RMSNorms, also around the attention and MLP outputs ("sandwich"); GeGLU (tanh-approximated GELU);
embeddings scaled by sqrt(hidden); attention scaled by query_pre_attn_scalar ** -0.5; sliding-window
layers interleaved with global ones; attention and final logits soft-capped (cap * tanh(x / cap)).
"""

from __future__ import annotations

from tokenmill.model.description import DecoderConfig
from tokenmill.model.llama import LlamaForCausalLM

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")  # one function, two implementations in transformers


class Gemma2ForCausalLM(LlamaForCausalLM):
    # What transformers' config class assumes for keys a config.json leaves out.
    defaults = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                "rms_norm_eps": 1e-6, "sliding_window": 4096, "tie_word_embeddings": True, "rope_theta": 10_000.0,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    window_pattern = 2  # without layer_types, every window_pattern-th layer is global

    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """The description of a Gemma model, from its HF config dict."""
        c = {**cls.defaults, **hf_config}
        name = cls.__name__.removesuffix("ForCausalLM")
        if c.get("use_bidirectional_attention"):
            raise ValueError(f"{name} configs with use_bidirectional_attention (embedding models) are not supported: "
                             "this decoder is causal")
        activation = c.get("hidden_activation") or c.get("hidden_act")
        if activation not in _GELU_TANH:
            raise ValueError(f"{name} activation {activation!r} is not supported (supported: {', '.join(_GELU_TANH)})")
        if c.get("layer_types") is None:
            pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or cls.window_pattern
            c["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(c["num_hidden_layers"])]
        return DecoderConfig.from_hf(c, **cls.switches(c))

    @classmethod
    def switches(cls, c: dict) -> dict:
        """The description's fields (DecoderConfig.from_hf's keywords) for a config with defaults filled in."""
        return dict(norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True,
                    attn_scale=c["query_pre_attn_scalar"] ** -0.5, embed_scale=c["hidden_size"] ** 0.5,
                    attn_softcap=c.get("attn_logit_softcapping"), final_softcap=c.get("final_logit_softcapping"))
