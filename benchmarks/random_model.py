"""A Hugging Face folder holding a model of the default model's exact shapes with random weights, and its
real tokenizer: for speed measurements where the default model's file cannot go (speed does not depend
on the weights' values; run requests with ignore_eos).

    python benchmarks/random_model.py OUT_FOLDER
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from tokenmill import LLM  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory=1 << 24)
    c = llm.engine.model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    llm.get_tokenizer().save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
