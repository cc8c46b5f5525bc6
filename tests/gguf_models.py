"""Tiny GGUF files (Llama, Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), float or with quantized
tensors, written with the gguf package as llama.cpp's converter lays them out (tokenizer in metadata): fixtures
for the GGUF loader and the quantized-weight path."""

from __future__ import annotations

import json

import numpy as np

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "TQ2_0")  # the types gguf's Python code can quantize


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of the rotary halves of a q/k projection (the loader undoes it)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes per row] of valid blocks of a type gguf cannot quantize to (the K formats, IQ4_NL, IQ4_XS):
    random codes and sub-block scales, the float16 block scales set so that weights come out at about the size
    of a small model's (any bit pattern of the rest is a valid block)."""
    import gguf

    T = gguf.GGMLQuantizationType
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    # the largest |code x sub-block scale| of each type, against Q4_K's 63 x 15
    reach = {T.Q2_K: 15 * 3, T.Q3_K: 32 * 4, T.IQ4_XS: 32 * 127, T.IQ4_NL: 127}.get(qtype, 63 * 15)
    scales = (rng.uniform(2e-5, 1.5e-4, (rows, cols // block, 2)) * (63 * 15 / reach)).astype(np.float16)
    if qtype in (T.Q6_K, T.Q3_K):  # d: the last 2 bytes
        data[..., -2:] = scales[..., :1].view(np.uint8)
    elif qtype == T.Q2_K:  # d, dmin: the last 4
        data[..., -4:] = scales.view(np.uint8).reshape(rows, cols // block, 4)
    elif qtype in (T.IQ4_NL, T.IQ4_XS):  # d leads the block
        data[..., 0:2] = scales[..., :1].view(np.uint8)
    else:  # d, dmin lead the block
        data[..., 0:4] = scales.view(np.uint8).reshape(rows, cols // block, 4)
    return data.reshape(rows, -1)


def llama3_rope_factors(s: dict, head_dim: int, theta: float) -> np.ndarray:
    """The divisor of each rope frequency under llama3 rope scaling `s`, as llama.cpp's converter stores it
    in a rope_freqs tensor: 1 for short wavelengths, `factor` for long ones, between them the reciprocal
    of the blend (1 - smooth) / factor + smooth that transformers applies to the frequency."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    blend = 1.0 / ((1 - smooth) / s["factor"] + smooth)
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, s["factor"], blend)).astype(np.float32)


_ARCH = {"llama": "llama", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",  # HF model_type -> GGUF arch
         "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


def _moe_metadata(writer, cfg: dict) -> None:
    """What llama.cpp's converter writes for a mixture-of-experts model beside the common keys (Mixtral's
    feed_forward_length is its experts' size, written as the common key)."""
    writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _stack_experts(state: dict, legacy: bool = False) -> dict:
    """The checkpoint's tensors with each layer's experts stacked as llama.cpp's converter stacks them:
    blk.N.ffn_{gate,up,down}_exps, [n_expert, rows, cols] in numpy order (gate and up [n_expert, n_ff,
    n_embd], down [n_expert, n_embd, n_ff]); other tensors as they are. legacy: one tensor per expert,
    blk.N.ffn_{gate,up,down}.E, as Mixtral files were written before the experts were stacked."""
    import re

    import torch

    out, experts = {}, {}
    for hf, tensor in state.items():
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", hf)
        if m and legacy:
            out[f"blk.{m.group(1)}.{_EXPERT_PARTS[m.group(3)].removesuffix('_exps')}.{m.group(2)}.weight"] = tensor
        elif m:
            experts.setdefault(f"blk.{m.group(1)}.{_EXPERT_PARTS[m.group(3)]}.weight", {})[int(m.group(2))] = tensor
        else:
            out[hf] = tensor
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _gpt_oss_tensors(state: dict) -> dict:
    """gpt-oss's checkpoint tensors as llama.cpp's converter writes them: each layer's stacked experts split
    into blk.N.ffn_{gate,up,down}_exps ([n_expert, rows, cols] in numpy order; gate at the even columns of
    gate_up_proj, up at the odd ones) with their biases [n_expert, rows], each layer's sinks as
    blk.N.attn_sinks; the rest in HF naming, the router under mlp.gate."""
    import re

    out = {}
    for hf, t in state.items():
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(gate_up_proj|down_proj)(_bias)?|self_attn\.(sinks))$",
                     hf)
        if m is None:
            out[hf.replace(".mlp.router.", ".mlp.gate.")] = t
            continue
        layer, which, bias, sinks = m.groups()
        blk, kind = f"blk.{layer}", "bias" if bias else "weight"
        if sinks:
            out[f"{blk}.attn_sinks.weight"] = t
        elif which == "down_proj":
            out[f"{blk}.ffn_down_exps.{kind}"] = t if bias else t.transpose(1, 2)
        else:
            for part, columns in (("gate", t[..., ::2]), ("up", t[..., 1::2])):
                out[f"{blk}.ffn_{part}_exps.{kind}"] = columns if bias else columns.transpose(1, 2)
    return out


def _phi3_metadata(writer, cfg: dict, rope: dict) -> None:
    """What llama.cpp's converter writes for a Phi-3 model beside the common keys."""
    import math

    heads = cfg["num_attention_heads"]
    original = cfg["original_max_position_embeddings"]
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def write_llama_gguf(path, folder: str, types, metadata: dict | None = None, skip: tuple[str, ...] = (),
                     legacy_experts: bool = False) -> str:
    """The tiny model in `folder` (HF format, with its tokenizer; Llama, Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE
    or Qwen3-MoE) as a GGUF file, laid out as llama.cpp's converter lays it out: Llama's (and Mixtral's) q/k rows
    permuted and its llama3 rope scaling as a rope_freqs tensor; Gemma's norm weights stored as 1 + w; Phi-3's
    merged qkv and gate/up projections as attn_qkv and ffn_up, its LongRoPE factors as rope_factors_long /
    rope_factors_short tensors and its rotary dims, original context and attention factor as metadata; experts
    stacked per layer (ffn_*_exps), Mixtral as arch llama with expert counts, routers (ffn_gate_inp) kept F32
    as llama.cpp's quantizer keeps them. types(gguf name) gives each weight's type name:
    F32, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/MXFP4/TQ2_0 (quantized from the folder's weights) or another (random blocks: the
    file's weights are then whatever those blocks hold). Norms stay F32. metadata: more key/value pairs
    (floats as FLOAT32, ints as INT32). skip: GGUF tensor names left out. legacy_experts: one tensor per expert
    (blk.N.ffn_gate.E, ...), the layout of older Mixtral files."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    arch = _ARCH[cfg["model_type"]]
    gemma = arch.startswith("gemma")
    state = load_file(f"{folder}/model.safetensors")
    tok = AutoTokenizer.from_pretrained(folder)
    rng = np.random.default_rng(0)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = cfg.get("rope_parameters") or {}
    if gemma or (cfg.get("head_dim") or cfg["hidden_size"] // heads) != cfg["hidden_size"] // heads:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if gemma:
        writer.add_sliding_window(cfg["sliding_window"])
        rope = rope.get("full_attention", rope)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                writer.add_float32(f"{arch}.{key}", float(cfg[key]))
    theta = cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)
    writer.add_rope_freq_base(theta)
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":
        _phi3_metadata(writer, cfg, rope)
    if arch == "gpt-oss":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_expert_feed_forward_length(cfg["intermediate_size"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if cfg.get("num_local_experts") or cfg.get("num_experts"):
        _moe_metadata(writer, cfg)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    added = {a.content for a in tok.backend_tokenizer.get_added_tokens_decoder().values()}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(cfg.get("bos_token_id", 1))
    writer.add_eos_token_id(cfg.get("eos_token_id", 2))
    for key, value in (metadata or {}).items():
        writer.add_float32(key, value) if isinstance(value, float) else writer.add_int32(key, value)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    if gemma:
        parts.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    if arch == "gpt-oss":
        parts["post_attention_layernorm"] = "post_attention_norm"
        state = _gpt_oss_tensors(state)
    if arch == "phi3":
        parts.update({"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"})
        if rope.get("rope_type") == "longrope":
            for which in ("long", "short"):
                writer.add_tensor(f"rope_factors_{which}.weight", np.asarray(rope[f"{which}_factor"], dtype=np.float32))
    if scaling and scaling["rope_type"] == "llama3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, head_dim, theta))
    for hf, tensor in _stack_experts(state, legacy_experts).items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if hf.startswith("blk."):
            name = hf
        elif hf.startswith("model.layers."):
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            rest, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{parts[rest]}.{kind}"
        else:
            name = names[hf]
        if name in skip:
            continue
        w = tensor.to(torch.float32).numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # llama.cpp's shape: [n_embd]
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute(w, heads if "attn_q" in name else kv_heads)
        kind = "F32" if w.ndim == 1 or name.endswith((".bias", "ffn_gate_inp.weight")) else types(name)
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in QUANTIZABLE:
            data = gguf.quants.quantize(w, qtype)
        else:
            data = random_k_blocks(qtype, int(np.prod(w.shape[:-1])), w.shape[-1], rng).reshape(*w.shape[:-1], -1)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
