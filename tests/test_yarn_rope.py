"""YaRN rope scaling at real sizes against transformers' own computation: gpt-oss's (unrounded blend range,
its released config), a Qwen-style one (the range rounded outwards, transformers' default), and DeepSeek's
mscale pair; then the cos/sin tables the decoder reads."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.description import DecoderConfig
from tokenmill.model.gpt_oss import GptOssForCausalLM
from tokenmill.model.rotary import RotaryEmbedding, rope_inv_freq

CASES = {
    "gpt-oss-20b": ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096}, 150000.0, 64),
    "qwen-yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1000000.0, 128),
    "mscale": ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32,
                "beta_slow": 1, "original_max_position_embeddings": 4096}, 10000.0, 64),
    "attention-factor": ({"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.25,
                          "original_max_position_embeddings": 8192}, 500000.0, 128),
}


def _reference(scaling: dict, theta: float, head_dim: int):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters={**scaling, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_frequencies_and_attention_factor_match_transformers(case):
    scaling, theta, head_dim = CASES[case]
    want_freq, want_factor = _reference(scaling, theta, head_dim)
    freq, factor = rope_inv_freq(head_dim, theta, scaling)
    assert torch.equal(freq, want_freq.float())
    assert factor == pytest.approx(want_factor, rel=1e-12)
    plain, _ = rope_inv_freq(head_dim, theta, None)
    assert not torch.allclose(freq, plain)  # the scaling changes something


def test_rounding_the_blend_range_matters():
    """gpt-oss's unrounded range and the rounded default give different frequencies at gpt-oss's sizes: a
    file or config that says which must be read as it says."""
    scaling, theta, head_dim = CASES["gpt-oss-20b"]
    unrounded, _ = rope_inv_freq(head_dim, theta, scaling)
    rounded, _ = rope_inv_freq(head_dim, theta, {**scaling, "truncate": True})
    assert not torch.allclose(unrounded, rounded)


def test_gpt_oss_config_tables():
    """A gpt-oss config as released (rope_parameters from transformers 5, or no rope keys at all: its
    defaults): the decoder's cos/sin rows equal transformers' GptOssRotaryEmbedding's."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = GptOssConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=8192)
    for given in (hf.to_dict(), {k: v for k, v in hf.to_dict().items() if "rope" not in k}):
        cfg: DecoderConfig = GptOssForCausalLM.describe({**given, "architectures": ["GptOssForCausalLM"]})
        spec = cfg.ropes[0]
        ours = RotaryEmbedding(cfg.rotary_dim, 8192, spec.theta, spec.scaling)
        positions = torch.tensor([[0, 1, 17, 4095, 4096, 8191]])
        cos, sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.allclose(ours.cos[positions[0], :32], cos[0], atol=1e-6)
        assert torch.allclose(ours.sin[positions[0], :32], sin[0], atol=1e-6)
