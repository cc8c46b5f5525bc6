"""Engine configuration, validated once at start."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from tokenmill.attention import kv_format
from tokenmill.spec.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB' or '512MB'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(value)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must be a byte count such as 1073741824 or '1GiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def resolve_device(device: str | None) -> torch.device:
    """'auto' picks CUDA where present, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but this torch build sees no CUDA GPU")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    """'auto': bfloat16 where the hardware runs it fast, else the checkpoint's dtype or float32."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            resolved = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            # CPUs with AVX-512 BF16 / AMX run bf16 matmuls several times faster than fp32,
            # and bf16 halves the bytes each decode step reads.
            resolved = torch.bfloat16 if _cpu_has_fast_bf16() else (model_dtype or torch.float32)
            if resolved == torch.float16:
                resolved = torch.float32
    else:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")
        resolved = _DTYPES[dtype]
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype float16 is not supported on the CPU; use bfloat16 or float32")
    return resolved


def _cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


QUANTIZATION = ("auto", "none", "int8", "int4", "int4-gptq", "fp8")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs besides the model itself."""

    model: str | None = None
    dtype: str | torch.dtype = "auto"
    # "auto": a quantized GGUF file runs in its own block formats (as llama.cpp runs it); "none":
    # every weight is dequantized to dtype at load (the reference path); "int8" / "int4": float weights
    # are quantized at load (groups of 32; the embedding and output layer at 8 bits; int8 on a GPU, or on a
    # CPU without tokenmill's kernels: a scale per channel, torch's int8 product); "int4-gptq": int4 whose
    # linear layers are fitted at load to the inputs they see on a calibration text (model/calibrate.py:
    # GPTQ; a load of the float model and a pass over 8k tokens first); "fp8": float weights
    # become e4m3 codes with a scale per output channel, multiplied by torch's FP8 product (GPUs with FP8
    # tensor cores; the embedding and output layer stay float).
    quantization: str = "auto"
    device: str | None = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # While requests decode, one request's prompt chunk per step is at most this many tokens (0: no cap,
    # the whole budget): a step lasts as long as its prompt tokens take, and every decode in it waits.
    long_prefill_token_threshold: int = 512
    kv_cache_memory: int | str = "1GiB"
    # "auto": the KV cache holds the model's dtype; "int8" / "fp8" (e4m3): 8-bit codes with a scale per
    # token and KV head, about half the bytes of bfloat16 (a quarter of float32) per token.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    seed: int = 0
    enable_prefix_caching: bool = True
    # Greedy decode steps one engine step may run back to back where the CPU decode kernels run (1: one
    # step at a time). Fewer returns to Python per token; outputs then arrive a few tokens at a time.
    num_scheduler_steps: int = 8
    # On a GPU, decode-only steps replay CUDA graphs of the forward pass (one launch instead of hundreds);
    # True keeps every step eager.
    enforce_eager: bool = False
    # Sampling defaults of requests that leave fields out: "auto" (the model's generation_config, then
    # the GGUF's sampling metadata, then a built-in model's recommended values, then llama.cpp's
    # defaults), "vllm" (neutral OpenAI defaults) or a path to a generation_config.json or its folder.
    generation_config: str = "auto"
    override_generation_config: dict | None = None  # fields set over whichever defaults won
    # Speculative decoding (a dict, a JSON object or a SpeculativeConfig; None: off), e.g.
    # {"method": "ngram", "num_speculative_tokens": 4}: see spec/config.py.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Ranks the model is split over (heads and MLP rows; distributed/): processes on this host, each with its
    # share of the CPUs and its slice of the weights and KV cache (kv_cache_memory is each rank's).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (no cap) or a positive integer, got "
                             f"{self.long_prefill_token_threshold}")
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be a positive integer, got {self.num_scheduler_steps}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two up to 256, got {self.block_size}")
        self.kv_cache_dtype = kv_format.normalize(self.kv_cache_dtype)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.quantization not in QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION)}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.exists(self.generation_config):
            raise ValueError("generation_config must be auto, vllm or the path of a generation_config.json (or "
                             f"its folder); {self.generation_config!r} does not exist")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.speculative_config is not None \
                and self.speculative_config.method == "self":
            raise ValueError("speculative decoding with method 'self' does not run with tensor_parallel_size > 1 "
                             "(its draft is a quantized copy of the whole model); use 'ngram' or 'draft_model'")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict of sampling fields, e.g. "
                             '{"temperature": 0.5}')
