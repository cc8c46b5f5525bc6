"""The Llama decoder, which Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and the mixture-of-experts families
(Mixtral, Qwen2-MoE, Qwen3-MoE) reuse through their descriptions."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import quant
from tokenmill.model.description import ACTIVATIONS, DecoderConfig, layer_windows  # noqa: F401 (re-export)
from tokenmill.model.layers import Embedding, GatedMLP, Linear, MergedLinear, RMSNorm, softcap
from tokenmill.model.moe import EXPERT_WEIGHT, PARTS, Experts, SparseMoE
from tokenmill.model.rotary import RotaryEmbedding, apply_rotary

logger = logging.getLogger("tokenmill")


def norm_of(cfg: DecoderConfig, dim: int) -> RMSNorm:
    """An RMSNorm over dim values as the description's norms compute."""
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset, cfg.norm_weight_in_float)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = norm_of(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm_of(cfg, cfg.head_dim) if cfg.qk_norm else None
        # gpt-oss: each head's sink logit (in the model's dtype, as the reference holds it), which joins the
        # denominator of the head's softmax.
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        self.backend = backend
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_softcap
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
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                 softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        norm = lambda: norm_of(cfg, cfg.hidden_size)  # noqa: E731
        # Registered in the order a forward pass reads them (the weight arena follows this order).
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, backend, cfg.layer_windows[index])
        # Llama: the norm before the MLP. With sandwich norms: the norm of the attention output.
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.activation, (cfg.glu_alpha, cfg.glu_limit))
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.activation,
                                (cfg.glu_alpha, cfg.glu_limit))
        if self.sandwich:
            self.post_feedforward_layernorm = norm()
        self.rope = cfg.layer_ropes[index]

    @property
    def ffn_norm(self) -> RMSNorm:
        """The norm of the MLP's input."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x, ropes, kv_cache, meta):
        h = self.self_attn(self.input_layernorm(x), ropes[self.rope], kv_cache, meta)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer over a flat batch of tokens from many requests."""

    qkv_bias: bool | None = None  # None: from the config's attention_bias
    qk_norm: bool = False
    per_layer_windows: bool = True  # False: the config's one window applies to every layer

    def __init__(self, hf_config: dict, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        cfg = self.describe(hf_config)
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = norm_of(cfg, cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotaries = self.make_rotaries(max_positions)

    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """This architecture's description of a model, from its HF config dict."""
        return DecoderConfig.from_hf(hf_config, qkv_bias=cls.qkv_bias, qk_norm=cls.qk_norm,
                                     per_layer_windows=cls.per_layer_windows)

    def make_rotaries(self, max_positions: int) -> nn.ModuleList:
        """The rotary tables (one per distinct rope of the description) for positions below max_positions."""
        cfg = self.config
        return nn.ModuleList(RotaryEmbedding(cfg.rotary_dim, max(max_positions, 1), r.theta, r.scaling)
                             for r in cfg.ropes)

    @property
    def kv_recompute_length(self) -> int | None:
        """A sequence longer than this computes its keys and values differently (LongRoPE's long factors,
        rotary.py): the engine recomputes a request that grows past it. None: no such length."""
        switches = [r.switch for r in self.rotaries if r.switch is not None]
        return min(switches) if switches else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; K/V of the new tokens are written to kv_caches."""
        fused = self._fused_decoder(kv_caches, meta)
        if fused is not None:
            return fused.forward(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_seq_lens)
        x = self.embed_tokens(input_ids, self.norm.weight.dtype)
        if self.config.embed_scale != 1.0:
            x = x * self.embed_scale(x.dtype)
        ropes = [r.lookup(positions, x.dtype, meta.request_lens) for r in self.rotaries]
        rows = x.shape[0]
        with quant.prompt_rows(rows, rows - meta.num_prompt_rows):
            for layer, kv in zip(self.layers, kv_caches):
                x = layer(x, ropes, kv, meta)
        return self.norm(x)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """The embedding scale as the reference applies it: rounded to the model dtype first."""
        return torch.tensor(self.config.embed_scale, dtype=torch.float32).to(dtype).item()

    # ------------------------------------------------------------------ fused decode
    use_fused_decode = True  # False keeps every step on the module-by-module path

    @property
    def graph_capturable(self) -> bool:
        """Whether a decode step can be recorded in a CUDA graph: not with mixture-of-experts layers, whose
        step reads which experts are active (a host sync, and shapes that change from step to step)."""
        return self.config.moe is None

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

    def built_fused_decoder(self):
        """The fused decoder if a decode step has built it, else None."""
        cached = getattr(self, "_fused", None)
        return None if cached is None else cached[1]

    def _build_fused_decoder(self, kv_caches: list, block_size: int):
        kernels = cpu_kernels.load()
        cfg = self.config
        if kernels is None:
            return None
        if any(w.qtype is None for m in self.modules() for w in getattr(m, "qparts", ())):
            logger.info("the fused decode step takes float and GGUF-block weights, not fp8: decode steps run module "
                        "by module")
            return None
        moe_sizes = [] if cfg.moe is None else [cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size]
        if any(size % 32 for size in moe_sizes):
            logger.info("the fused decode step takes experts whose sizes are multiples of 32 (this model: %s): "
                        "decode steps run module by module", " and ".join(map(str, filter(None, moe_sizes))))
            return None
        if self.tp_group is not None and self.tp_group.fused is None:
            logger.info("the fused decode step sums over tensor-parallel ranks of one host only: decode steps run "
                        "module by module")
            return None
        # A tensor-parallel shard runs the fused step only where every rank's shard can.
        shards = self.tp_shard.rank_sizes() if self.tp_shard is not None else \
            [(cfg.num_heads * cfg.head_dim, cfg.intermediate_size)]
        if not cpu_kernels.head_dim_ok(cfg.head_dim) or cfg.hidden_size % 32 or \
                any(q % 32 or i % 32 for q, i in shards):
            logger.info("the fused decode step takes head_dim a multiple of 16 up to 128 or 256, and sizes that are "
                        "multiples of 32 (this model: head_dim %d, hidden %d, intermediate %d): decode steps run "
                        "module by module", cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)
            return None

        def t(module, name="weight"):  # the parameter (shared storage, not a copy), or None
            p = None if module is None else getattr(module, name)
            return None if p is None else p.detach()

        dtype = self.norm.weight.dtype
        decoder = kernels.FusedDecoderBF16 if dtype == torch.bfloat16 else kernels.FusedDecoderF32
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        # A decode step holds each request's last token, whose rotary row goes by position.
        first, *more = (r.position_tables() for r in self.rotaries)
        fused = decoder(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
                        cfg.attn_scale, block_size, t(self.norm), self.embed_tokens.fused_parts(),
                        head.fused_parts(), *first, norm_offset=cfg.norm_offset,
                        activation=ACTIVATIONS.index(cfg.activation), embed_scale=self.embed_scale(dtype),
                        attn_softcap=cfg.attn_softcap or 0.0, final_softcap=cfg.final_softcap or 0.0,
                        norm_in_float=cfg.norm_weight_in_float, glu_alpha=cfg.glu_alpha, glu_limit=cfg.glu_limit)
        for tables in more:
            fused.add_rope(*tables)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            a, m = layer.self_attn, layer.mlp
            sandwich = layer.sandwich
            sparse = isinstance(m, SparseMoE)  # its experts follow (set_experts), in place of gate_up and down
            mlp = ([], None, [], None) if sparse else (m.gate_up_proj.fused_parts(), t(m.gate_up_proj, "bias"),
                                                       m.down_proj.fused_parts(), t(m.down_proj, "bias"))
            fused.add_layer(t(layer.input_layernorm), a.qkv_proj.fused_parts(), t(a.qkv_proj, "bias"), t(a.q_norm),
                            t(a.k_norm), a.o_proj.fused_parts(), t(a.o_proj, "bias"), t(layer.ffn_norm), *mlp,
                            *kv_format.kernel_args(k_cache, v_cache, a.sliding_window or 0),
                            attn_out_norm=t(layer.post_attention_layernorm) if sandwich else None,
                            ffn_out_norm=t(layer.post_feedforward_layernorm) if sandwich else None, rope=layer.rope,
                            sinks=t(a, "sinks"))
            if sparse:
                m.add_to_fused(fused)
        if self.tp_group is not None:
            fused.set_group(self.tp_group.fused, self.tp_shard.vocab_range[0], cfg.vocab_size)
        return fused

    tp_group = tp_shard = None  # a tensor-parallel shard's group and Shard (distributed/tensor_parallel.py)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.embed_tokens.as_output(hidden) if self.lm_head is None else self.lm_head(hidden)
        if self.tp_group is not None:
            from tokenmill.distributed.tensor_parallel import gather_vocab

            logits = gather_vocab(self.tp_group, logits, self.config.vocab_size)
        return softcap(logits, self.config.final_softcap)

    # ------------------------------------------------------------------ weights
    _STACKED = {  # checkpoint name part -> (fused module name part, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    quantized = False  # True once any linear layer or the embedding holds a quantized weight

    def packed_weights(self, hf_config: dict, keep: bool) -> set[str]:
        """The weights (Hugging Face names) that a Hugging Face checkpoint holds in a block format and that
        stay in it (keep: its kernels run here), for quantize_weights; checkpoint_weights dequantizes the
        others. Empty for the families whose checkpoints are float."""
        return set()

    def checkpoint_weights(self, weights):
        """The checkpoint's (name, tensor) pairs in the naming and layout load_weights takes; families whose
        checkpoints lay tensors out otherwise (gpt-oss's stacked experts) convert here."""
        return weights

    def canonical_name(self, name: str) -> str:
        """A checkpoint name (without "model.") in the naming the modules follow; families that name their
        tensors otherwise (Mixtral's experts) translate here."""
        return name

    def _weight_module(self, name: str) -> tuple[str, int]:
        """(the module holding a checkpoint weight, the weight's part in it) for a Hugging Face name."""
        name = self.canonical_name(name.removeprefix("model."))
        expert = EXPERT_WEIGHT.match(name)
        if expert:
            return expert.group(1), PARTS.index(expert.group(3))
        parts = name.split(".")
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
            module_name, part = self._weight_module(name)
            module = self.get_submodule(module_name)
            if isinstance(module, Experts):
                module.quantize_part(part)
                self.quantized = True
            elif not module.quantized:
                module.quantize_weight()
                self.quantized = True

    def _checkpoint_names(self) -> set[str]:
        """The Hugging Face names (without "model.") of the tensors a checkpoint must hold for this model:
        each part of a merged projection under its own name."""
        names = set()
        for module_name, module in self.named_modules():
            if isinstance(module, Experts):
                names.update(module.checkpoint_names(module_name))
                continue
            if not hasattr(module, "weight"):
                continue
            for kind in ("weight", "bias"):
                if getattr(module, kind, None) is None and not (kind == "weight" and getattr(module, "quantized", False)):
                    continue
                names.update(self._parts_of(f"{module_name}.{kind}"))
        names.update(n for n, _ in self.named_parameters() if n.endswith(".sinks"))
        return names

    def _parts_of(self, name: str) -> list[str]:
        """The checkpoint names of the parts of a merged projection's tensor (itself where it is not one)."""
        parts = name.split(".")
        unstacked = [part for part, (fused, _) in self._STACKED.items() if len(parts) >= 2 and fused == parts[-2]]
        return [".".join(parts[:-2] + [part, parts[-1]]) for part in unstacked] or [name]

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the fused parameters, each part of a merged
        projection on its own or the merged tensor whole (Phi-3's qkv_proj, gate_up_proj); quantized weights
        (QuantizedWeight) go to the modules quantize_weights() prepared for them. A checkpoint that lacks
        any tensor, a part of a merged projection included, raises MissingWeights."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = self.canonical_name(name.removeprefix("model."))
            if "rotary_emb" in name:
                continue
            expert = EXPERT_WEIGHT.match(name)
            if expert:  # one expert's matrix (or bias), or (from GGUF) all experts' stacked
                prefix, index, part, kind = expert.group(1), expert.group(2), PARTS.index(expert.group(3)), \
                    expert.group(4)
                experts = self.get_submodule(prefix)
                index = None if index is None else int(index)
                (experts.load if kind == "weight" else experts.load_bias)(part, tensor, index)
                loaded.update(experts.checkpoint_names(prefix, [part], None if index is None else [index], (kind,)))
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
                loaded.update(self._parts_of(name))
                continue
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, idx = self._STACKED[parts[-2]]
                module_name = ".".join(parts[:-2] + [fused])
                module = self.get_submodule(module_name)
                module.load_shard(idx, tensor, is_bias=parts[-1] == "bias")
                loaded.add(name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            loaded.update(self._parts_of(name))
        missing = self._checkpoint_names() - loaded
        if missing:
            raise MissingWeights(sorted(n if n.startswith("lm_head.") else f"model.{n}" for n in missing))


class MissingWeights(ValueError):
    """A checkpoint lacks tensors the model needs; `names` in Hugging Face naming."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"checkpoint lacks {len(names)} tensors, e.g. {names[:3]}")
        self.names = names
