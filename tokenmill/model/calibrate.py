"""Calibrated 4-bit weights (quantization "int4-gptq"): each linear layer's Q4_1 blocks chosen by GPTQ
(kernels/quant.py, `gptq_q4_1`) against the inputs that layer sees on a calibration text.

The float model runs the calibration windows one decoder layer at a time: a first pass of a layer sums
x x^T of each linear layer's inputs (its Hessian), the layer's weights are then quantized against it,
and a second pass through the now-quantized layer gives the next layer its inputs, so that each layer is
fitted to the inputs it will see once the layers before it are quantized. The embedding, the output
layer and mixture-of-experts experts are not calibrated (the loader rounds them as quantization "int4"
does); routers stay float."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kernels import quant

logger = logging.getLogger("tokenmill")

WINDOW = 512  # tokens a calibration window holds (fewer where the model's positions are fewer)
TOKENS = 8192  # calibration tokens in all
GROUP_TOKENS = 2048  # tokens one forward pass of a layer takes at a time
BLOCK_SIZE = 16
Q4_1 = 3  # GGML type id


def calibration_windows(tokenizer, tokens: int = TOKENS, window: int = WINDOW) -> list[list[int]]:
    """Windows of `window` tokens of the built-in calibration text (tokenmill.data.calibration_text, never
    the evaluation text), each opening with BOS where the tokenizer starts sequences with it."""
    from tokenmill.data import calibration_text
    from tokenmill.eval import windows

    ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
    probe = tokenizer.encode("a")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None and probe and probe[0] == tokenizer.bos_token_id \
        else None
    return [w for w, _ in windows(ids, window, window, bos)[:max(1, tokens // window)]]


def _calibrated(module: nn.Module) -> bool:
    from tokenmill.model.layers import Embedding, _QuantizableLinear

    return (isinstance(module, _QuantizableLinear) and not isinstance(module, Embedding)
            and getattr(module, "weight", None) is not None and module.in_features % 32 == 0
            and not getattr(module, "keep_float", False))


@torch.inference_mode()
def gptq_int4(model: nn.Module, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Q4_1 blocks [rows, bytes per row] of each calibrated linear layer of a float model (loaded with
    quantization "none"), by module name. The model's weights are left rounded to those blocks."""
    start = time.perf_counter()
    if not windows or len({len(w) for w in windows}) != 1:
        raise ValueError("calibration needs windows of one length")
    dtype = model.norm.weight.dtype
    cfg = model.config
    length = len(windows[0])
    per = max(1, GROUP_TOKENS // length)  # windows a pass takes
    ids = torch.tensor([t for w in windows for t in w], dtype=torch.long)
    x = model.embed_tokens(ids, dtype)
    if cfg.embed_scale != 1.0:
        x = x * model.embed_scale(x.dtype)

    def group_inputs(count: int):
        """Rotary tables, metadata and a KV cache for `count` windows in one pass (each window a request)."""
        tokens = count * length
        positions = torch.arange(length).repeat(count)
        ropes = [r.lookup(positions, dtype) for r in model.rotaries]
        blocks = -(-length // BLOCK_SIZE)
        meta = AttentionMetadata(
            slot_mapping=torch.cat([torch.arange(length) + i * blocks * BLOCK_SIZE for i in range(count)]),
            query_start_loc=[i * length for i in range(count + 1)], seq_lens=[length] * count, num_decodes=0,
            decode_block_tables=None, decode_seq_lens=None,
            block_tables=[torch.arange(blocks) + i * blocks for i in range(count)], block_size=BLOCK_SIZE,
            num_prompt_rows=tokens)
        slots = count * blocks * BLOCK_SIZE
        new = lambda shape, dt: torch.zeros(shape, dtype=dt)  # noqa: E731
        kv = tuple(kv_format.new_cache("auto", slots, cfg.num_kv_heads, cfg.head_dim, dtype, new) for _ in range(2))
        return ropes, meta, kv

    shapes = {}
    def run(layer, x):
        out = torch.empty_like(x)
        for s in range(0, len(windows), per):
            count = min(per, len(windows) - s)
            if count not in shapes:
                shapes[count] = group_inputs(count)
            ropes, meta, kv = shapes[count]
            meta.cache.clear()
            rows = slice(s * length, (s + count) * length)
            out[rows] = layer(x[rows], ropes, kv, meta)
        return out

    fitted: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        targets = {name: m for name, m in layer.named_modules() if _calibrated(m)}
        hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in targets.items()}

        def accumulate(name):
            def hook(module, args):
                a = args[0].reshape(-1, module.in_features).float()
                hessians[name].addmm_(a.T, a)
            return hook

        hooks = [m.register_forward_pre_hook(accumulate(name)) for name, m in targets.items()]
        try:
            run(layer, x)
        finally:
            for h in hooks:
                h.remove()
        for name, m in targets.items():
            full = f"layers.{index}.{name}"
            blocks = quant.gptq_q4_1(m.weight, hessians[name], full)
            fitted[full] = blocks
            m.weight.copy_(quant.QuantizedWeight.from_blocks(Q4_1, tuple(m.weight.shape), blocks, full).dequantize())
        del hessians
        x = run(layer, x)
    logger.info("fitted %d layers' 4-bit weights to %d calibration tokens (GPTQ) in %.1f s", len(fitted),
                len(windows) * length, time.perf_counter() - start)
    return fitted
