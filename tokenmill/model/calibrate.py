"""Calibrated 4-bit weights (quantization "int4-gptq"): each linear layer's Q4_1 blocks chosen by GPTQ
(kernels/quant.py, `gptq_q4_1`) against the inputs that layer sees on a calibration text.

The blocks are kept in the model cache (`fitted_int4`), keyed by the checkpoint files (names, sizes,
modification times), the dtype and the calibration's settings: a model is fitted once (minutes for 1B
parameters on 2 cores), and later loads read the blocks.

The float model runs the calibration windows one decoder layer at a time: a first pass of a layer sums
x x^T of each linear layer's inputs (its Hessian), the layer's weights are then quantized against it,
and a second pass through the now-quantized layer gives the next layer its inputs, so that each layer is
fitted to the inputs it will see once the layers before it are quantized. The embedding, the output
layer and mixture-of-experts experts are not calibrated (the loader rounds them as quantization "int4"
does); routers stay float."""

from __future__ import annotations

import hashlib
import logging
import os
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
VERSION = "gptq-q4_1-1"  # of the fit: a change to what it computes takes a new name (the cache's key)


def calibration_windows(tokenizer, tokens: int = TOKENS, window: int = WINDOW) -> list[list[int]]:
    """Windows of `window` tokens of the built-in calibration text (tokenmill.data.calibration_text, never
    the evaluation text), each opening with BOS where the tokenizer starts sequences with it."""
    from tokenmill.data import calibration_text
    from tokenmill.eval import sequence_bos, windows

    ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
    return [w for w, _ in windows(ids, window, window, sequence_bos(tokenizer))[:max(1, tokens // window)]]


def cache_file(path: str, dtype: torch.dtype, window: int) -> str:
    """Where the fitted blocks of the checkpoint at path (a .gguf file or a model folder) are kept."""
    from tokenmill.model.hub import cache_dir

    key = hashlib.sha256(f"{VERSION} {TOKENS} {window} {dtype} {os.path.realpath(path)}".encode())
    files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path))
    for f in files:
        if os.path.isfile(f):
            st = os.stat(f)
            key.update(f"|{os.path.basename(f)} {st.st_size} {st.st_mtime_ns}".encode())
    return os.path.join(cache_dir(), "calibrated", key.hexdigest()[:32] + ".pt")


def fitted_int4(path: str, dtype: torch.dtype, window: int, load_float,
                threads: int | None = None) -> dict[str, torch.Tensor]:
    """gptq_int4's blocks for the checkpoint at path: from the cache, or fitted on load_float()'s model
    (a LoadedModel at quantization "none") and then kept there. Processes loading the same checkpoint at
    once (tensor-parallel ranks) fit it once: one fits while the others wait, then they read its file.
    threads: how many the fit runs on, where not the caller's own count (a rank's share of the CPUs: the
    ranks that wait leave theirs idle)."""
    import fcntl

    file = cache_file(path, dtype, window)
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        folder = os.open(os.path.dirname(file), os.O_RDONLY)
    except OSError:  # a cache that cannot be written: fitted here, and not kept (_fitted_int4 says so)
        return _fitted_int4(file, window, load_float, threads)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # the folder's: released when closed, or when its holder dies
        return _fitted_int4(file, window, load_float, threads)
    finally:
        os.close(folder)


def _fitted_int4(file: str, window: int, load_float, threads: int | None) -> dict[str, torch.Tensor]:
    if os.path.exists(file):
        try:
            fitted = torch.load(file, weights_only=True)
            if not isinstance(fitted, dict) or not all(isinstance(b, torch.Tensor) and b.dtype == torch.uint8
                                                       for b in fitted.values()):
                raise ValueError("not a dict of block tensors")
            logger.info("int4-gptq: fitted blocks of %d matrices from %s", len(fitted), file)
            return fitted
        except Exception as e:  # a truncated or foreign file: fit again, and replace it
            logger.warning("int4-gptq: %s could not be read (%s): fitting again", file, e)
    logger.info("int4-gptq: the float model first, to fit each layer's 4-bit weights to its inputs")
    own = torch.get_num_threads()
    torch.set_num_threads(threads or own)
    try:
        reference = load_float()
        fitted = gptq_int4(reference.model, calibration_windows(reference.tokenizer, window=window))
        del reference
    finally:
        torch.set_num_threads(own)
    try:
        torch.save(fitted, file + ".tmp")
        os.replace(file + ".tmp", file)
        logger.info("int4-gptq: fitted blocks kept in %s (%.1f MiB)", file,
                    sum(b.numel() for b in fitted.values()) / 2**20)
    except OSError as e:
        logger.warning("int4-gptq: could not keep the fitted blocks in %s (%s)", file, e)
    return fitted


def _calibrated(module: nn.Module) -> bool:
    from tokenmill.model.layers import Embedding, takes_blocks

    return takes_blocks(module) and not isinstance(module, Embedding) and getattr(module, "weight", None) is not None


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

    by_count: dict[int, tuple] = {}

    def run(layer, x):
        """The layer's outputs for every window, `per` windows a pass."""
        out = torch.empty_like(x)
        for s in range(0, len(windows), per):
            count = min(per, len(windows) - s)
            if count not in by_count:
                by_count[count] = group_inputs(count)
            ropes, meta, kv = by_count[count]
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
    logger.info("fitted %d matrices' 4-bit weights to %d calibration tokens (GPTQ) in %.1f s", len(fitted),
                len(windows) * length, time.perf_counter() - start)
    return fitted
