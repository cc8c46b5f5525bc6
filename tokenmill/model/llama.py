"""The Llama decoder, which Mistral, Qwen2 and Qwen3 reuse with a few switches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.layers import Embedding, GatedMLP, Linear, MergedLinear, RMSNorm, RotaryEmbedding, apply_rotary


@dataclass(slots=True)
class DecoderConfig:
    """The hyper-parameters the decoder needs, read from an HF config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: list[int | None]  # per layer: the sliding attention window, or None for full attention

    @classmethod
    def from_hf(cls, c: dict, *, qkv_bias: bool | None = None, qk_norm: bool = False,
                per_layer_windows: bool = True) -> "DecoderConfig":
        heads = c["num_attention_heads"]
        attention_bias = bool(c.get("attention_bias", False))
        rope_scaling = c.get("rope_scaling")
        rope_theta = c.get("rope_theta")
        # Newer configs keep rope settings under rope_parameters.
        params = c.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=qk_norm,
            layer_windows=layer_windows(c, per_layer_windows),
        )


def layer_windows(c: dict, per_layer: bool = True) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from an HF config dict, by transformers' rules:
    `layer_types` where present; else, with `max_window_layers` (Qwen2/Qwen3), the window only from that
    layer on; else one window for every layer (Mistral). per_layer=False ignores both, as transformers'
    Mistral does."""
    n = c["num_hidden_layers"]
    window = (c.get("sliding_window") if c.get("use_sliding_window", True) else None) or None
    types = c.get("layer_types") if per_layer else None
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {n}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported by this decoder; "
                             "expected sliding_attention or full_attention")
        return [window if t == "sliding_attention" else None for t in types]
    first = c.get("max_window_layers") if per_layer else None
    if first is not None:
        return [window if i >= first else None for i in range(n)]
    return [window] * n


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = window

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, cfg.layer_windows[index])
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over a flat batch of tokens from many requests."""

    qkv_bias: bool | None = None  # None: from the config's attention_bias
    qk_norm: bool = False
    per_layer_windows: bool = True  # False: the config's one window applies to every layer

    def __init__(self, hf_config: dict, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        cfg = DecoderConfig.from_hf(hf_config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                                    per_layer_windows=self.per_layer_windows)
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max(max_positions, 1), cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; K/V of the new tokens are written to kv_caches."""
        fused = self._fused_decoder(kv_caches, meta)
        if fused is not None:
            return fused.forward(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_seq_lens)
        x = self.embed_tokens(input_ids, self.norm.weight.dtype)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    # ------------------------------------------------------------------ fused decode
    use_fused_decode = True  # False keeps every step on the module-by-module path

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                      meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits [T, vocab] of a decode-only step from the fused decoder, the layers and the output layer
        in one call; None where the fused decoder does not run this step."""
        fused = self._fused_decoder(kv_caches, meta)
        if fused is None:
            return None
        return fused.logits(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                            meta.decode_seq_lens)

    def _fused_decoder(self, kv_caches: list, meta: AttentionMetadata):
        """The compiled whole-step decoder when this step is decode only, float32 or bf16 on a CPU that runs
        it; else None."""
        dtype = self.norm.weight.dtype
        if not (self.use_fused_decode and meta.num_reqs and meta.num_decodes == meta.num_reqs
                and dtype in (torch.float32, torch.bfloat16) and self.norm.weight.device.type == "cpu"):
            return None
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), meta.block_size)
        cached = getattr(self, "_fused", None)
        if cached is None or cached[0] != key:
            cached = (key, self._build_fused_decoder(kv_caches, meta.block_size))
            self._fused = cached
        return cached[1]

    def _build_fused_decoder(self, kv_caches: list, block_size: int):
        kernels = cpu_kernels.load()
        cfg = self.config
        if kernels is None or cfg.head_dim % 16 or cfg.head_dim > 128 or \
                any(n % 32 for n in (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)):
            return None

        def t(module, name="weight"):  # the parameter (shared storage, not a copy), or None
            p = None if module is None else getattr(module, name)
            return None if p is None else p.detach()

        dtype = self.norm.weight.dtype
        decoder = kernels.FusedDecoderBF16 if dtype == torch.bfloat16 else kernels.FusedDecoderF32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        fused = decoder(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
                        self.layers[0].self_attn.scale, block_size, t(self.norm), self.embed_tokens.fused_parts(),
                        head.fused_parts(), self.rotary.cos.float(), self.rotary.sin.float())
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            a, m = layer.self_attn, layer.mlp
            fused.add_layer(t(layer.input_layernorm), a.qkv_proj.fused_parts(), t(a.qkv_proj, "bias"), t(a.q_norm),
                            t(a.k_norm), a.o_proj.fused_parts(), t(a.o_proj, "bias"), t(layer.post_attention_layernorm),
                            m.gate_up_proj.fused_parts(), t(m.gate_up_proj, "bias"), m.down_proj.fused_parts(),
                            t(m.down_proj, "bias"), *kv_format.kernel_args(k_cache, v_cache, a.sliding_window or 0))
        return fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.as_output(hidden) if self.lm_head is None else self.lm_head(hidden)

    # ------------------------------------------------------------------ weights
    _STACKED = {  # checkpoint name part -> (fused module name part, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    quantized = False  # True once any linear layer or the embedding holds a quantized weight

    def _weight_module(self, name: str) -> tuple[str, int]:
        """(the module holding a checkpoint weight, the weight's part in it) for a Hugging Face name."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 2 and parts[-2] in self._STACKED:
            fused, idx = self._STACKED[parts[-2]]
            return ".".join(parts[:-2] + [fused]), idx
        return ".".join(parts[:-1]), 0

    def quantize_weights(self, names) -> None:
        """Before the weights are materialized: the checkpoint weights `names` (Hugging Face naming) will
        arrive quantized, so their modules keep no float copy."""
        for name in names:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            module = self.get_submodule(self._weight_module(name)[0])
            if not module.quantized:
                module.quantize_weight()
                self.quantized = True

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the fused parameters; quantized weights
        (QuantizedWeight) go to the modules quantize_weights() prepared for them."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            parts = name.split(".")
            if not isinstance(tensor, torch.Tensor):
                module_name, idx = self._weight_module(name)
                module = self.get_submodule(module_name)
                if not getattr(module, "quantized", False):
                    raise ValueError(f"checkpoint tensor {name!r} is quantized but its layer was not prepared for it")
                module.load_quantized(idx, tensor)
                continue
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, idx = self._STACKED[parts[-2]]
                module_name = ".".join(parts[:-2] + [fused])
                module = self.get_submodule(module_name)
                module.load_shard(idx, tensor, is_bias=parts[-1] == "bias")
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        missing |= {f"{n}.weight" for n, m in self.named_modules() if getattr(m, "missing_parts", False)}
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
