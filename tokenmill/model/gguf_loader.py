"""GGUF files: hyper-parameters and tokenizer from metadata, weights dequantized with the gguf package."""

from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.model import gguf_tokenizer

logger = logging.getLogger("tokenmill")

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
          "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
          "gpt-oss": "GptOssForCausalLM"}
# Mixtral has no architecture of its own in GGUF: llama.cpp writes it as llama with llama.expert_count set.
_GEMMA = ("gemma2", "gemma3")

# GGUF tensor name (after blk.N.) -> Hugging Face name (after model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, every expert's matrices stacked [n_expert, rows, cols], and Qwen2-MoE's
    # shared expert and its gate.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's four norms a layer: ffn_norm is the norm before the MLP, post_attention_norm the attention output's.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: the norm before the experts is post_attention_norm; each head's attention sink a tensor of its own.
_GPT_OSS_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                        "attn_sinks": "self_attn.sinks"}
# Phi-3's merged projections: q/k/v in one attn_qkv, gate and up in one ffn_up (gate first), as its checkpoints.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_PHI3_MERGED = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Not weights: llama.cpp's Llama 3 rope frequency factors and Phi-3's LongRoPE factors, read into the config.
_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _layer_names(arch: str) -> dict[str, str]:
    """GGUF tensor name (after blk.N.) -> Hugging Face name (after model.layers.N.) in files of `arch`."""
    return _GEMMA_LAYER_NAMES if arch in _GEMMA else _PHI3_LAYER_NAMES if arch == "phi3" else \
        _GPT_OSS_LAYER_NAMES if arch == "gpt-oss" else _LAYER_NAMES


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGML order: the fastest-varying dimension first
    tensor_type: int  # a gguf.GGMLQuantizationType value
    data: np.ndarray  # the raw bytes, [rows, bytes per row], memory-mapped


class GGUFFile:
    """A GGUF file's metadata (decoded to Python values) and tensor index, its data memory-mapped.

    The format: magic, version, tensor and key/value counts; key/value pairs; tensor infos (name, dims,
    type, offset); the tensor data, aligned. Read here in one pass: the gguf package's reader builds an
    object per field part, which takes seconds for a 49,000-token vocabulary.
    """

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
              12: "<f8"}

    def __init__(self, path: str) -> None:
        try:
            self._parse(path)
        except (struct.error, UnicodeDecodeError, KeyError, OverflowError) as e:
            raise ValueError(f"{path!r} is truncated or not a valid GGUF file ({type(e).__name__}: {e})") from None

    def _parse(self, path: str) -> None:
        import gguf

        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file")
        self._pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = []
        for name, dims, ttype, offset in infos:
            if ttype not in gguf.GGMLQuantizationType._value2member_map_:
                raise ValueError(f"GGUF tensor {name!r} has an unknown type {ttype}")
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            if not dims or dims[0] % block:
                raise ValueError(f"GGUF tensor {name!r} of shape {list(dims)} does not divide into "
                                 f"{gguf.GGMLQuantizationType(ttype).name} blocks of {block} elements")
            row_bytes = dims[0] // block * type_bytes
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            end = start + offset + rows * row_bytes
            if end > len(self._buf):
                raise ValueError(f"{path!r} is truncated: tensor {name!r} ends past the end of the file")
            data = self._buf[start + offset:end].reshape(rows, row_bytes)
            self.tensors.append(GGUFTensor(name, dims, gguf.GGMLQuantizationType(ttype), data))
        self.arch = self.fields.get("general.architecture")

    def _read(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._read("<Q")
        s = bytes(self._mv[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == 8:
            return self._string()
        if vtype == 9:  # array: element type, count, elements
            etype, count = self._read("<I"), self._read("<Q")
            if etype in self._NUMPY:
                arr = np.frombuffer(self._mv, dtype=self._NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        if vtype not in self._SCALARS:
            raise ValueError(f"GGUF metadata value type {vtype} is not understood")
        return self._read(self._SCALARS[vtype])


def read_config(reader: GGUFFile) -> dict:
    """An HF-style config dict built from GGUF metadata."""
    arch = reader.fields.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHS))}")

    def g(key, default=None):
        return reader.fields.get(f"{arch}.{key}", default)

    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens") or []
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
        "attention_bias": "blk.0.attn_q.bias" in names and arch not in ("qwen2", "qwen2moe"),
        "sliding_window": g("attention.sliding_window"),
    }
    scaling_type = g("rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    elif scaling_type == "yarn":
        config["rope_scaling"] = _yarn_scaling(g, arch, config)
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in names:
        if scaling_type not in (None, "none"):
            raise ValueError(f"GGUF file has both rope scaling {scaling_type!r} and a rope_freqs tensor")
        # Llama 3.1+ files keep their llama3 rope scaling as the factor each frequency is divided by.
        config["rope_scaling"] = {"rope_type": "freq_factors", "factors": _rope_freq_factors(reader)}
    if g("expert_count"):
        config.update(_moe_config(reader, g, config))
    if arch in _GEMMA:
        config.update(_gemma_config(g, config))
    if arch == "phi3":
        config.update(_phi3_config(reader, g, config))
    return config


def _yarn_scaling(g, arch: str, config: dict) -> dict:
    """YaRN rope scaling from a GGUF's rope.scaling keys. The files do not say whether the blend's
    dimension range is rounded outwards to whole dimensions: gpt-oss's own definition does not round it (its
    HF config says truncate false), the other families' HF configs do (transformers' default)."""
    scaling = {"rope_type": "yarn", "factor": g("rope.scaling.factor"),
               "original_max_position_embeddings": g("rope.scaling.original_context_length")
               or config["max_position_embeddings"],
               "beta_fast": g("rope.scaling.yarn_beta_fast") or 32.0,
               "beta_slow": g("rope.scaling.yarn_beta_slow") or 1.0, "truncate": arch != "gpt-oss"}
    # llama.cpp's converter writes a config's attention_factor as yarn_attn_factor.
    attention = g("rope.scaling.yarn_attn_factor", g("rope.scaling.attn_factor"))
    if attention is not None:
        scaling["attention_factor"] = attention
    return scaling


def _moe_config(reader: GGUFFile, g, config: dict) -> dict:
    """The mixture-of-experts entries of an HF config from a GGUF's metadata: expert counts and sizes; a layer
    without a router (ffn_gate_inp) is dense (mlp_only_layers). The top-k weights are renormalised where
    expert_weights_norm says, else as llama.cpp does for the architecture (all but qwen2moe)."""
    arch = config["model_type"]
    names = {t.name for t in reader.tensors}
    experts = g("expert_count")
    out = {"num_experts_per_tok": g("expert_used_count"),
           "moe_intermediate_size": g("expert_feed_forward_length") or config["intermediate_size"],
           "mlp_only_layers": [i for i in range(config["num_hidden_layers"])
                               if f"blk.{i}.ffn_gate_inp.weight" not in names],
           "norm_topk_prob": bool(g("expert_weights_norm", arch != "qwen2moe"))}
    if arch == "llama":
        if out["mlp_only_layers"]:
            raise ValueError(f"Mixtral GGUF file lacks the router of layers {out['mlp_only_layers']} (ffn_gate_inp)")
        return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts}
    out["num_experts"] = experts
    if arch == "gpt-oss":  # its experts' size is the config's intermediate_size
        return {**out, "num_local_experts": experts, "intermediate_size": out["moe_intermediate_size"]}
    if arch == "qwen2moe":
        shared = next((t.shape[1] for t in reader.tensors if t.name.endswith(".ffn_gate_shexp.weight")), 0)
        out.update(shared_expert_intermediate_size=g("expert_shared_feed_forward_length") or shared,
                   qkv_bias="blk.0.attn_q.bias" in names)
    return out


def _phi3_config(reader: GGUFFile, g, config: dict) -> dict:
    """The Phi-3-only entries of an HF config from a phi3 GGUF: partial rotary from rope.dimension_count,
    LongRoPE from the rope_factors_long / rope_factors_short tensors and the rope.scaling keys."""
    out = {"original_max_position_embeddings": g("rope.scaling.original_context_length")
           or config["max_position_embeddings"]}
    dims = g("rope.dimension_count")
    if dims:
        factor = dims / config["head_dim"]
        # The description takes int(head_dim * factor) dims, as transformers does: keep that product whole.
        out["partial_rotary_factor"] = factor if int(config["head_dim"] * factor) == dims else \
            (dims + 0.5) / config["head_dim"]
    names = {t.name for t in reader.tensors}
    factors = {k: f"rope_factors_{k}.weight" for k in ("short", "long")}
    present = [k for k, n in factors.items() if n in names]
    if len(present) == 1:
        raise ValueError(f"GGUF file has {factors[present[0]]!r} but not the other LongRoPE factors tensor; "
                         "LongRoPE needs both")
    if present:
        out["rope_scaling"] = {"rope_type": "longrope", "short_factor": _tensor_values(reader, factors["short"]),
                               "long_factor": _tensor_values(reader, factors["long"]),
                               "original_max_position_embeddings": out["original_max_position_embeddings"]}
        if g("rope.scaling.attn_factor") is not None:
            out["rope_scaling"]["attention_factor"] = g("rope.scaling.attn_factor")
    return out


def _rope_freq_factors(reader: GGUFFile) -> list[float]:
    return _tensor_values(reader, "rope_freqs.weight")


def _tensor_values(reader: GGUFFile, name: str) -> list[float]:
    """A small tensor's values, as a flat list of floats."""
    from gguf.quants import dequantize

    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).tolist()


def _gemma_config(g, config: dict) -> dict:
    """The Gemma-only entries of an HF config from a gemma2 / gemma3 GGUF's metadata (g: key -> value)."""
    heads, hidden, layers = config["num_attention_heads"], config["hidden_size"], config["num_hidden_layers"]
    gemma3 = config["model_type"] == "gemma3"
    out = {"model_type": "gemma3_text" if gemma3 else "gemma2",
           # The files do not say; llama.cpp scales queries by hidden / heads in the 27B models (62 layers in
           # Gemma 3, 46 in Gemma 2), by head_dim in the others, as their HF configs' query_pre_attn_scalar.
           "query_pre_attn_scalar": hidden // heads if layers == (62 if gemma3 else 46) else config["head_dim"]}
    if gemma3:
        out["rope_local_base_freq"] = g("rope.freq_base_swa", 10000.0)
    pattern = g("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: whether it slides
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if g(key) is not None:
            out[key] = g(key)
    return out


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Llama q/k projections."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of a GGUF tensor of a file of architecture `arch`."""
    m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$", name)
    if m:  # one expert's matrix, the layout of Mixtral files written before the experts were stacked
        layer, part, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", name)
    if m:
        layer, part, kind = m.groups()
        names = _layer_names(arch)
        if part not in names:
            raise ValueError(f"GGUF tensor {name!r} is not understood")
        if part == "attn_sinks":  # a parameter of its own, not a layer's weight
            return f"model.layers.{layer}.{names[part]}"
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base not in _TOP_NAMES:
        raise ValueError(f"GGUF tensor {name!r} is not understood")
    return f"{_TOP_NAMES[base]}.{kind}"


def gguf_name(hf: str, arch: str) -> str:
    """The GGUF name of a Hugging Face tensor name, in a file of architecture `arch` (_hf_name's inverse)."""
    m = re.match(r"model\.layers\.(\d+)\.self_attn\.sinks$", hf)
    if m:
        return f"blk.{m.group(1)}.attn_sinks.weight"
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if m:
        layer, part, kind = m.groups()
        names = {v: k for k, v in _layer_names(arch).items()}
        part = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.", part)  # one expert's: in the stacked tensor
        if arch == "phi3":  # the parts of a merged projection: its converter writes them as one tensor
            names.update({p: merged for merged, parts in _PHI3_MERGED.items() for p in parts})
        return f"blk.{layer}.{names.get(part, part)}.{kind}"
    base, _, kind = hf.rpartition(".")
    top = {v: k for k, v in _TOP_NAMES.items()}
    return f"{top.get(base, base)}.{kind}"


# Projections the decoder stores as one matrix: kept quantized only where every part is.
_MERGED = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
           ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
           ("mlp.experts.gate_proj", "mlp.experts.up_proj")]  # the experts' float gate and up share one tensor
_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16


def quantized_types(reader: GGUFFile) -> list[str]:
    """Names of the file's tensor types that are not float (F32, F16, BF16)."""
    return sorted({t.tensor_type.name for t in reader.tensors if int(t.tensor_type) not in _FLOAT_TYPES})


def _merged_group(name: str) -> list[str]:
    """The Hugging Face names of the parts of the merged projection `name` belongs to (itself alone if none)."""
    m = re.match(r"(model\.layers\.\d+\.)(.+)\.weight$", name)
    for parts in _MERGED if m else []:
        if m.group(2) in parts:
            return [f"{m.group(1)}{p}.weight" for p in parts]
    return [name]


def down_block(reader: GGUFFile) -> int:
    """The largest block of the formats the file's down projections are in (32 where none has a kernel's
    block format): a tensor-parallel cut of their columns falls on its multiples (distributed/shard.py)."""
    from tokenmill.kernels import quant

    blocks = [quant.FORMATS[int(t.tensor_type)][1] for t in reader.tensors
              if t.name.split(".")[-2].startswith("ffn_down") and int(t.tensor_type) in quant.FORMATS]
    return max(blocks, default=32)


def quantized_plan(reader: GGUFFile, shard=None) -> set[str]:
    """Hugging Face names of the weights that stay in their GGUF block format: the linear layers' and the
    embedding's, where a kernel runs that format. Other quantized tensors are dequantized at load, logged.
    A tensor-parallel shard (distributed/shard.py) also dequantizes a matrix whose columns it cuts between
    blocks (a row-parallel K/world not a multiple of the format's block)."""
    from tokenmill.kernels import quant

    candidates, without_kernel = set(), {}
    for t in reader.tensors:
        if int(t.tensor_type) in _FLOAT_TYPES or t.name in _NOT_WEIGHTS:
            continue
        hf = _hf_name(t.name, reader.arch)
        stacked = ".experts." in hf  # [n_expert, rows, cols]: each expert's slice runs in the format
        if re.search(r"\.experts\.\d+\.", hf):
            without_kernel.setdefault("experts stored one tensor each (an older layout)", []).append(t.name)
        elif int(t.tensor_type) in quant.FORMATS and len(t.shape) == (3 if stacked else 2) and hf.endswith(".weight") \
                and "norm" not in hf:
            shape = (int(np.prod(t.shape[1:], dtype=np.int64)), int(t.shape[0]))
            if shard is not None and not shard.splits_blocks(hf.removeprefix("model."), shape,
                                                             quant.FORMATS[int(t.tensor_type)][1]):
                without_kernel.setdefault("a tensor-parallel cut between blocks", []).append(t.name)
            else:
                candidates.add(hf)
        else:
            without_kernel.setdefault(f"no kernel for {t.tensor_type.name}", []).append(t.name)
    for why, names in without_kernel.items():
        logger.info("%s: %d tensors dequantized at load (e.g. %s)", why, len(names), names[0])
    if candidates and quant.load() is None:
        logger.warning("quantized-weight kernels unavailable: every quantized tensor is dequantized at load")
        return set()
    return {name for name in candidates if set(_merged_group(name)) <= candidates}


def quantized_layout(reader: GGUFFile, plan: set[str]) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Where each planned tensor goes in one buffer: name -> (byte offset, rows, bytes per row), and the
    buffer's size. Tensors keep the file's order, except that the parts of a merged projection are placed
    one after another in their merged order (so the merged matrix is a view, not a copy)."""
    tensors = [t for t in reader.tensors if t.name not in _NOT_WEIGHTS]
    by_name = {_hf_name(t.name, reader.arch): t for t in tensors}
    layout, total = {}, 0
    for t in tensors:
        hf = _hf_name(t.name, reader.arch)
        if hf not in plan or hf in layout:
            continue
        total = -(-total // 64) * 64
        for name in _merged_group(hf):
            data = by_name[name].data if name in by_name else None
            if data is None or name not in plan:
                raise ValueError(f"GGUF file lacks tensor {gguf_name(name, reader.arch)!r}, a part of a merged "
                                 "projection")
            layout[name] = (total, data.shape[0], data.shape[1])
            total += data.shape[0] * data.shape[1]
    return layout, total


def iter_weights(reader, config: dict, keep: set[str] = frozenset(), place: dict | None = None, shard=None):
    """(Hugging Face name, tensor) for every tensor: a QuantizedWeight (the file's blocks) for the names in
    `keep`, written into place[name] where given, else a float32 tensor, dequantized. A tensor-parallel
    shard's blocks are cut here, before they are repacked (its float tensors are cut by the loader)."""
    from gguf.quants import dequantize

    from tokenmill.kernels.quant import FORMATS, QuantizedWeight

    permute = config["model_type"] in ("llama", "mistral", "mixtral")
    # llama.cpp's converter stores Gemma's norm weights w as 1 + w (the scale it multiplies by).
    norm_shift = 1.0 if reader.arch in _GEMMA else 0.0
    for t in reader.tensors:
        if t.name in _NOT_WEIGHTS:
            continue
        hf = _hf_name(t.name, reader.arch)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else None
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(part)
        if hf in keep:
            shape = (int(np.prod(t.shape[1:], dtype=np.int64)), int(t.shape[0]))
            rows = _unpermute(t.data, heads) if permute and heads else t.data
            if shard is not None:
                _, block, block_bytes = FORMATS[int(t.tensor_type)]
                rows, shape = shard.block_rows(hf.removeprefix("model."), np.asarray(rows).reshape(shape[0], -1),
                                               shape, block, block_bytes)
            data = torch.from_numpy(np.array(rows, copy=True, order="C"))
            out = (place or {}).get(hf)
            # (a stacked expert tensor, [experts, rows, cols], is sliced by expert, after any shard's cut:
            # tiled only where each expert's rows are whole tiles)
            tile_rows = shape[0] // int(t.shape[2]) if len(t.shape) == 3 else None
            yield hf, QuantizedWeight.from_blocks(int(t.tensor_type), shape, data, name=t.name, out=out,
                                                  tile_rows=tile_rows)
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be read") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if permute and heads:
            arr = _unpermute(arr, heads)
        if part == "ffn_gate_inp_shexp":  # llama.cpp's shape is [n_embd]; the gate's is [1, hidden]
            arr = arr.reshape(1, -1)
        if norm_shift and hf.endswith("norm.weight"):
            arr = arr - np.float32(norm_shift)
        if not arr.flags.writeable or not arr.flags.c_contiguous:  # F32 tensors come as read-only memory maps
            arr = np.array(arr, copy=True, order="C")
        yield hf, torch.from_numpy(arr)


def build_tokenizer(reader: GGUFFile):
    """A transformers fast tokenizer from the GGUF's tokenizer metadata; None where transformers must build it."""
    return gguf_tokenizer.build_tokenizer(reader.fields)
