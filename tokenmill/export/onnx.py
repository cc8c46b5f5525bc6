"""tokenmill export onnx: a model as one ONNX decoder graph with a KV cache, laid out as Hugging Face Optimum's
decoder exports are (opset 14, the same input and output names and dynamic axes), so that runtimes built
for those drive it; its config.json, generation_config.json and tokenizer files are written beside it.

The graph is torch.onnx's TorchScript exporter tracing export/torch_decoder.py over the model's float32
weights (a quantized GGUF's weights dequantized, as quantization="none" loads them).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import tempfile
import warnings

import torch

logger = logging.getLogger("tokenmill")

OPSET = 14  # Optimum's default opset for Llama-family decoders
MODEL_FILE = "model.onnx"


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """The graph's input and output names, in order."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def _dynamic_axes(inputs: list[str], outputs: list[str]) -> dict[str, dict[int, str]]:
    batch, new, past, total = "batch_size", "sequence_length", "past_sequence_length", \
        "past_sequence_length + sequence_length"
    axes = {"input_ids": {0: batch, 1: new}, "position_ids": {0: batch, 1: new},
            "attention_mask": {0: batch, 1: total}, "logits": {0: batch, 1: new}}
    axes.update({name: {0: batch, 2: past} for name in inputs if name.startswith("past_key_values.")})
    axes.update({name: {0: batch, 2: total} for name in outputs if name.startswith("present.")})
    return axes


def _writable_folder(out_dir: str) -> None:
    """Creates out_dir if needed; a ValueError saying what is wrong where it cannot be written to."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise ValueError(f"cannot write the export to {out_dir!r}: {e.strerror or e}; give a folder you can write "
                         "to") from None


def export_onnx(model: str | None, out_dir: str) -> str:
    """Writes MODEL's decoder graph (model.onnx) and its config, generation config and tokenizer files into
    out_dir; returns the graph's path. model: a Hugging Face folder, a .gguf file or a known name (None:
    the default model)."""
    from tokenmill.attention.cpu import TorchSDPABackend
    from tokenmill.export.torch_decoder import TorchDecoder
    from tokenmill.model.loader import load_model

    if importlib.util.find_spec("onnx") is None:
        raise ValueError("tokenmill export onnx needs the onnx package: pip install onnx (or tokenmill[onnx])")
    _writable_folder(out_dir)
    # Rotary tables are not read by the export (the graph computes its own): one row will do.
    loaded = load_model(model, torch.float32, torch.device("cpu"), TorchSDPABackend(), max_positions=1,
                        quantization="none")
    decoder = TorchDecoder(loaded.model).eval()
    cfg = decoder.config
    inputs, outputs = io_names(cfg.num_layers)
    batch, new, past = 2, 3, 4  # traced with a past of more than one token, so none of the sizes is special
    example = [torch.randint(0, cfg.vocab_size, (batch, new)), torch.ones(batch, past + new, dtype=torch.long),
               torch.arange(past, past + new).repeat(batch, 1)]
    example += [torch.zeros(batch, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    path = os.path.join(out_dir, MODEL_FILE)
    logger.info("exporting %s (%s) to %s", loaded.path, loaded.hf_config["architectures"][0], path)
    # The TorchScript exporter writes Optimum's opset 14; torch.export's starts at opset 18 and cannot go lower.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx|tokenmill")
        torch.onnx.export(decoder, tuple(example), path, input_names=inputs, output_names=outputs,
                          dynamic_axes=_dynamic_axes(inputs, outputs), opset_version=OPSET, dynamo=False)
    _write_json(os.path.join(out_dir, "config.json"), _config(loaded))
    if loaded.generation_config:
        _write_json(os.path.join(out_dir, "generation_config.json"), loaded.generation_config)
    loaded.tokenizer.save_pretrained(out_dir)
    return path


def _config(loaded) -> dict:
    """The model's HF config as runtimes read it (sizes, special tokens), for the float32 graph."""
    config = dict(loaded.hf_config)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "freq_factors":
        # A GGUF's Llama 3 rope as per-frequency divisors has no HF spelling; the graph holds it.
        config.pop("rope_scaling")
    tok = loaded.tokenizer
    config.setdefault("eos_token_id", list(loaded.eos_token_ids) or None)
    if tok.bos_token_id is not None:
        config.setdefault("bos_token_id", tok.bos_token_id)
    config.update(use_cache=True, torch_dtype="float32")
    return config


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
