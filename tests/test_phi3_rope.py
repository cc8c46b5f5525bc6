"""Phi-3's rotary embeddings at their real sizes, read from config.json as the released models write it,
against transformers' Phi3RotaryEmbedding: LongRoPE's short and long factors, its attention factor, and
Phi-4-mini's partial rotary."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.rotary import RotaryEmbedding

SWITCH = 4096


def _config(kind: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rotary = 96  # Phi-4-mini: 0.75 of its head_dim of 128; Phi-3 and Phi-3.5-mini: all of 96
    hidden, heads = (3072, 24) if kind == "phi4-mini" else (3072, 32)
    factors = {"short_factor": (1 + 0.1 * torch.rand(rotary // 2, generator=g)).tolist(),
               "long_factor": (1 + 60 * torch.rand(rotary // 2, generator=g)).tolist()}
    c = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": hidden,
         "intermediate_size": 8192, "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": 8,
         "max_position_embeddings": 131072, "original_max_position_embeddings": SWITCH, "rope_theta": 10000.0,
         "sliding_window": 262144, "rope_scaling": {"type": "su" if kind == "phi3-su" else "longrope", **factors}}
    if kind == "phi4-mini":
        c["partial_rotary_factor"] = 0.75
    return c


@pytest.mark.parametrize("kind", ["phi3-su", "phi3.5", "phi4-mini"])
@pytest.mark.parametrize("length", [7, SWITCH, SWITCH + 1, 9000])
def test_tables_equal_transformers(kind, length):
    """Every position of a sequence of `length` tokens (transformers computes it in one pass) takes the
    cos and sin transformers gives it: short factors up to the switch, long ones past it."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    c = _config(kind)
    cfg = Phi3ForCausalLM.describe(c)
    assert (cfg.rotary_dim, cfg.head_dim) == ((96, 128) if kind == "phi4-mini" else (96, 96))
    spec = cfg.ropes[0]
    ours = RotaryEmbedding(cfg.rotary_dim, 10_000, spec.theta, spec.scaling)
    # transformers' Phi3Config checks an "su" dict before it copies original_max_position_embeddings into it.
    ref_config = {k: v for k, v in c.items() if k not in ("architectures", "model_type")}
    ref_config["rope_scaling"] = {**c["rope_scaling"], "original_max_position_embeddings": SWITCH}
    ref = Phi3RotaryEmbedding(Phi3Config(**ref_config))
    positions = torch.arange(length)
    cos, sin = ours.lookup(positions, torch.float32, torch.full((length,), length))
    want_cos, want_sin = ref(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=0, atol=2e-6)
    # The last position alone (a decode step's token) goes by position: the same rows.
    last, _ = ours.lookup(positions[-1:], torch.float32)
    torch.testing.assert_close(last[0, 0], want_cos[0, -1], rtol=0, atol=2e-6)
