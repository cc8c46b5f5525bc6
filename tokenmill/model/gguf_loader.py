"""GGUF files: hyper-parameters and tokenizer from metadata, weights dequantized with the gguf package."""

from __future__ import annotations

import re

import numpy as np
import torch

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name (after blk.N.) -> Hugging Face name (after model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader) -> dict:
    """An HF-style config dict built from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHS))}")

    def g(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    config = {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": g("vocab_size") or len(tokens),
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv") or heads,
        "head_dim": g("attention.key_length") or hidden // heads,
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "sliding_window": g("attention.sliding_window"),
    }
    scaling_type = g("rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1 style rope scaling) are not supported yet; "
                         "load the Hugging Face folder of this model instead")
    return config


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Llama q/k projections."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_weights(reader, config: dict):
    """(Hugging Face name, float32 tensor) for every tensor, dequantized."""
    from gguf.quants import dequantize

    permute = config["model_type"] in ("llama", "mistral")
    for t in reader.tensors:
        name = t.name
        m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
        if m:
            layer, part, kind = m.groups()
            if part not in _LAYER_NAMES:
                raise ValueError(f"GGUF tensor {name!r} is not understood")
            hf = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        else:
            base, _, kind = name.rpartition(".")
            if base not in _TOP_NAMES:
                raise ValueError(f"GGUF tensor {name!r} is not understood")
            hf = f"{_TOP_NAMES[base]}.{kind}"
        arr = dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if permute and m and m.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if m.group(2) == "attn_q" else config["num_key_value_heads"]
            arr = _unpermute(arr, heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:  # F32 tensors come as read-only memory maps
            arr = np.array(arr, copy=True, order="C")
        yield hf, torch.from_numpy(arr)


def build_tokenizer(reader):
    """A transformers fast tokenizer built from the GGUF's tokenizer metadata."""
    from transformers import PreTrainedTokenizerFast

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        return None  # other vocabularies go through transformers' own GGUF conversion
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, never split by BPE.
    specials = [AddedToken(tokens[i], special=types[i] == 3, normalized=False) for i in range(len(tokens))
                if types[i] in (3, 4)]
    tok.add_tokens(specials)

    def tok_of(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok_of("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=tok_of("eos"),
                                 unk_token=tok_of("unknown"), pad_token=tok_of("padding"))
    template = _field(reader, "tokenizer.chat_template")
    if template:
        hf.chat_template = template
    return hf
