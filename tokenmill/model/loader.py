"""Load a model: Hugging Face folders (safetensors) or GGUF files -> config, weights, tokenizer."""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model import arena, gguf_loader
from tokenmill.model.hub import resolve_model_path
from tokenmill.model.layers import RotaryEmbedding
from tokenmill.model.registry import model_class

logger = logging.getLogger("tokenmill")


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    hf_config: dict
    tokenizer: object  # a transformers fast tokenizer
    generation_config: dict = field(default_factory=dict)
    path: str = ""
    load_seconds: float = 0.0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.generation_config.get("eos_token_id", self.hf_config.get("eos_token_id"))
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def load_model(name: str | None, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
               max_positions: int | None = None) -> LoadedModel:
    """Resolve the name (None: the default model), read config and tokenizer, build and fill the model."""
    start = time.perf_counter()
    path = resolve_model_path(name)
    if path.endswith(".gguf"):
        reader = gguf_loader.GGUFFile(path)
        hf_config = gguf_loader.read_config(reader)
        tokenizer = gguf_loader.build_tokenizer(reader) or _transformers_gguf_tokenizer(path)
        weights = gguf_loader.iter_weights(reader, hf_config)
        generation_config = {}
    elif os.path.isdir(path):
        hf_config = _read_json(os.path.join(path, "config.json"), required=True)
        tokenizer = _hf_tokenizer(path)
        weights = _iter_hf_weights(path)
        generation_config = _read_json(os.path.join(path, "generation_config.json"))
    else:
        raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a .gguf file")

    if device.type == "cpu":
        cpu_kernels.load()  # compiled once per machine, cached by torch
    cls = model_class(hf_config)
    positions = max_positions or hf_config.get("max_position_embeddings", 4096)
    with torch.device("meta"):
        model = cls(hf_config, backend, positions)
    if device.type == "cpu":
        # One contiguous, huge-page-backed buffer for the weights (kept for measuring its read speed).
        model.weight_arena = arena.materialize(model, dtype)
    else:
        model = model.to_empty(device=device).to(dtype)
    model.load_weights(weights)
    cfg = model.config
    # Rotary tables are not weights: build them on the device, kept in float32 for accuracy.
    model.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling).to(device)
    model.eval()
    elapsed = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%s, %.1fM parameters, %s) in %.2f s", os.path.basename(path.rstrip("/")),
                hf_config["architectures"][0], n_params / 1e6, str(dtype).removeprefix("torch."), elapsed)
    return LoadedModel(model, hf_config, tokenizer, generation_config, path, elapsed)


def load_tokenizer(path: str):
    """The tokenizer alone, from a model folder or a .gguf file."""
    if path.endswith(".gguf"):
        return gguf_loader.build_tokenizer(gguf_loader.GGUFFile(path)) or _transformers_gguf_tokenizer(path)
    return _hf_tokenizer(path)


def _read_json(path: str, required: bool = False) -> dict:
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path} not found: a Hugging Face model folder needs a config.json")
        return {}
    with open(path) as f:
        return json.load(f)


def _iter_hf_weights(folder: str):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        return
    bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _hf_tokenizer(folder: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    template_file = os.path.join(folder, "chat_template.jinja")
    if not getattr(tok, "chat_template", None) and os.path.exists(template_file):
        with open(template_file) as f:
            tok.chat_template = f.read()
    return tok


def _transformers_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
