"""gpt-oss: a mixture-of-experts decoder with attention sinks, described for the shared Llama decoder.

- Attention: q, k, v and o biases; a learned sink logit per query head in each softmax's denominator;
  sliding-window (128 tokens) and full layers alternating, the sliding ones first; YaRN rope.
- Norms: RMSNorm whose weight scales the float32 normalised value (rounded once).
- Every layer's feed-forward is a mixture of experts: a router with a bias; each token's top k router
  logits, then a softmax over those k; experts whose projections have biases and whose activation is a
  clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).

The checkpoints keep each layer's experts stacked as gate_up_proj [E, hidden, 2 * I] (gate and up
columns interleaved: gate at even columns, up at odd) and down_proj [E, I, hidden], with biases; they
are split and transposed here into the shared modules' [E, rows, cols] per projection. The router is
mlp.router, which loads into mlp.gate.

OpenAI's released checkpoints hold the experts in MXFP4 (config.json's quantization_config says
quant_method "mxfp4"): <proj>_blocks [E, rows, cols / 32, 16] (two 4-bit codes a byte, element 2j in the
low nibble) and <proj>_scales [E, rows, cols / 32] (E8M0 exponents), rows being output features (gate_up's
interleaved). They are rewritten into GGUF's MXFP4 blocks (the scale byte, then element j in the low nibble
of byte j and element j + 16 in its high one) and run on the MXFP4 kernel; or, where the blocks cannot stay
(another device, no kernels, quantization "none" or requantized to int8 / int4), dequantized at load.
"""

from __future__ import annotations

import logging
import re

import torch

from tokenmill.model.description import DecoderConfig, MoESpec
from tokenmill.model.llama import LlamaForCausalLM

logger = logging.getLogger("tokenmill")

_STACKED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_PACKED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4 = 39  # GGML's type id


class GptOssForCausalLM(LlamaForCausalLM):
    # What transformers' config class assumes for keys a config.json leaves out.
    defaults = {"num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
                "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "attention_bias": True, "swiglu_alpha": 1.702,
                "swiglu_limit": 7.0, "tie_word_embeddings": False, "max_position_embeddings": 131072}
    default_rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 4096}

    @classmethod
    def describe(cls, hf_config: dict) -> DecoderConfig:
        """The description of a gpt-oss model, from its HF config dict."""
        c = {**cls.defaults, **hf_config}
        if c.get("rope_parameters") is None and c.get("rope_scaling") is None:
            c["rope_parameters"] = cls.default_rope
        if c.get("layer_types") is None:
            c["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(c["num_hidden_layers"])]
        moe = MoESpec.from_hf(c, intermediate_size=c["intermediate_size"], norm_topk_prob=False,
                              sparse_layers=[True] * c["num_hidden_layers"], shared_intermediate_size=0,
                              router_bias=True, softmax_after_topk=True, expert_bias=True)
        return DecoderConfig.from_hf(c, qkv_bias=bool(c["attention_bias"]), moe=moe, attn_sinks=True,
                                     norm_weight_in_float=True, activation="clamped_swiglu",
                                     glu_alpha=float(c["swiglu_alpha"]), glu_limit=float(c["swiglu_limit"]))

    keep_packed = False  # MXFP4 experts stay in their blocks (packed_weights)

    def packed_weights(self, hf_config: dict, keep: bool) -> set[str]:
        """Where the checkpoint's experts are MXFP4 (quantization_config): whether they stay so (keep), and
        then the names of the weights that arrive as blocks (for quantize_weights)."""
        method = (hf_config.get("quantization_config") or {}).get("quant_method")
        if method is None:
            return set()
        if method != "mxfp4":
            raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported (mxfp4 is)")
        self.keep_packed = keep
        if not keep:
            logger.info("the checkpoint's MXFP4 experts are dequantized at load (they stay MXFP4 only on the CPU "
                        "with its kernels, quantization 'auto', one rank)")
            return set()
        return {f"model.layers.{i}.mlp.experts.{part}.weight" for i in range(self.config.num_layers)
                for part in ("gate_proj", "up_proj", "down_proj")}

    def checkpoint_weights(self, weights):
        """The checkpoint's (name, tensor) pairs in the shared naming and layout: the stacked experts split
        per projection ([E, rows, cols], biases [E, rows]), the router under mlp.gate; MXFP4 experts as
        block-format weights [E * rows, cols] or dequantized."""
        packed: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            m = _PACKED.match(name)
            if m:  # a projection's blocks and scales arrive one after the other
                prefix, which, kind = m.groups()
                pair = packed.setdefault((prefix, which), {})
                pair[kind] = tensor
                if len(pair) == 2:
                    del packed[(prefix, which)]
                    yield from self._unpacked(prefix, which, pair["blocks"], pair["scales"])
                continue
            m = _STACKED.match(name)
            if m is None or not isinstance(tensor, torch.Tensor):
                yield name, tensor
                continue
            prefix, which, bias = m.groups()
            if which == "down_proj":
                yield (f"{prefix}.down_proj.bias", tensor) if bias else \
                    (f"{prefix}.down_proj.weight", tensor.transpose(1, 2))
                continue
            for part, columns in (("gate_proj", tensor[..., ::2]), ("up_proj", tensor[..., 1::2])):
                yield (f"{prefix}.{part}.bias", columns) if bias else \
                    (f"{prefix}.{part}.weight", columns.transpose(1, 2))
        for (prefix, which), pair in packed.items():
            raise ValueError(f"the checkpoint has {prefix}.{which}_{next(iter(pair))} without its "
                             f"{'scales' if 'blocks' in pair else 'blocks'}")

    def _unpacked(self, prefix: str, which: str, blocks: torch.Tensor, scales: torch.Tensor):
        """A projection's MXFP4 blocks [E, rows, groups, 16] and scales [E, rows, groups] as the shared
        modules take them: (name, weight) for gate and up (gate_up's even and odd rows) or for down."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
                or blocks.shape[-1] != 16:
            raise ValueError(f"{prefix}.{which}: MXFP4 blocks [E, rows, groups, 16] and scales [E, rows, groups] "
                             f"(uint8) expected, got {tuple(blocks.shape)} and {tuple(scales.shape)}")
        codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [E, rows, groups, 32]
        parts = [("down_proj", slice(None))] if which == "down_proj" else \
            [("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))]
        for part, rows in parts:
            c, e = codes[:, rows], scales[:, rows]
            experts, n, groups = e.shape
            if self.keep_packed:
                from tokenmill.kernels.quant import QuantizedWeight

                ggml = torch.cat([e.unsqueeze(-1), c[..., :16] | (c[..., 16:] << 4)], dim=-1)  # [.., 17]
                data = ggml.reshape(experts * n, groups * 17).contiguous()
                yield f"{prefix}.{part}.weight", QuantizedWeight.from_blocks(
                    _MXFP4, (experts * n, groups * 32), data, name=f"{prefix}.{which}")
            else:
                values = torch.tensor(_FP4)[c.long()] * torch.exp2(e.float() - 127).unsqueeze(-1)
                yield f"{prefix}.{part}.weight", values.reshape(experts, n, groups * 32)
