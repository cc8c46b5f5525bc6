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
from tokenmill.config import QUANTIZATION
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import quant
from tokenmill.memory import release_freed_heap
from tokenmill.model import arena, gguf_loader
from tokenmill.model.hub import named_model_at, resolve_model_path
from tokenmill.model.llama import MissingWeights
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
    gguf_sampling: dict = field(default_factory=dict)  # the file's general.sampling.* metadata
    named_model: str | None = None  # the built-in model this is, if it is one (model/hub.py)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.generation_config.get("eos_token_id", self.hf_config.get("eos_token_id"))
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


# Quantizations applied to float weights as they load.
AT_LOAD = (*quant.QUANTIZE_TO, "fp8")


def load_model(name: str | None, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
               max_positions: int | None = None, quantization: str = "auto", tensor_parallel=None) -> LoadedModel:
    """Resolve the name (None: the default model), read config and tokenizer, build and fill the model.

    quantization "auto" runs a quantized GGUF file in its own formats (the weights stay as the file holds
    them); "none" dequantizes every weight to dtype (the reference path); "int8" / "int4" quantize float
    weights at load (quantize_on_load). tensor_parallel: (rank, world, group) to load that rank's shard
    (distributed/shard.py), whose products sum over the group."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION)}, got {quantization!r}")
    start = time.perf_counter()
    path = resolve_model_path(name)
    quantized: set[str] = set()
    reader = shard = None
    if path.endswith(".gguf"):
        reader = gguf_loader.GGUFFile(path)
        hf_config = gguf_loader.read_config(reader)
        tokenizer = gguf_loader.build_tokenizer(reader) or _transformers_gguf_tokenizer(path)
        shard = _shard(hf_config, tensor_parallel, gguf_loader.down_block(reader) if quantization == "auto" else 32)
        if quantization == "auto" and device.type == "cpu":
            quantized = gguf_loader.quantized_plan(reader, shard)
        elif quantization == "auto" and gguf_loader.quantized_types(reader):
            logger.info("quantized GGUF weights are dequantized to %s on %s (their kernels run on the CPU)",
                        str(dtype).removeprefix("torch."), device.type)
        place = None
        if quantized and shard is None:  # the blocks go to one huge-page buffer, as the float weights do (arena.py)
            layout, total = gguf_loader.quantized_layout(reader, quantized)
            buffer = arena.huge_page_buffer(total)
            place = {name: buffer[off:off + rows * row_bytes].view(rows, row_bytes)
                     for name, (off, rows, row_bytes) in layout.items()}
        if quantization in AT_LOAD:
            kinds = gguf_loader.quantized_types(reader)
            if kinds:
                raise ValueError(f"{os.path.basename(path)} is already quantized ({', '.join(kinds)}); quantization "
                                 f"{quantization!r} applies to float weights (F32/F16/BF16 GGUF files, Hugging Face "
                                 "folders): leave it at 'auto' to run the file's own formats")
        weights = gguf_loader.iter_weights(reader, hf_config, quantized, place, shard)
        generation_config = {}
        gguf_sampling = {k: v for k, v in reader.fields.items() if k.startswith("general.sampling.")}
    elif os.path.isdir(path):
        hf_config = _read_json(os.path.join(path, "config.json"), required=True)
        tokenizer = _hf_tokenizer(path)
        weights = _iter_hf_weights(path)
        generation_config = _read_json(os.path.join(path, "generation_config.json"))
        gguf_sampling = {}
    else:
        raise ValueError(f"{path!r} is neither a Hugging Face model folder nor a .gguf file")

    # int8 through torch's own product where the CPU kernels do not run it: a GPU, or a CPU without them
    torch_int8 = quantization == "int8" and (device.type != "cpu" or quant.load() is None)
    if quantization in quant.QUANTIZE_TO and device.type != "cpu" and not torch_int8:
        raise ValueError(f"quantization {quantization!r} runs on the CPU kernels; on {device.type} load the "
                         "weights unquantized (quantization 'auto'), as int8 or as fp8")
    if quantization == "fp8" and tensor_parallel is not None:
        raise ValueError("quantization 'fp8' does not shard between tensor-parallel ranks yet: load the weights "
                         "unquantized, or run one rank")
    if tensor_parallel is not None and shard is None:
        shard = _shard(hf_config, tensor_parallel)  # (a model that does not split is refused here, before any fit)
    if device.type == "cpu":
        cpu_kernels.load()  # compiled once per machine, cached by torch (before a fit's threads, which it plans for)
    fitted = None
    if quantization == "int4-gptq":
        from tokenmill.model import calibrate

        window = min(calibrate.WINDOW, max_positions or calibrate.WINDOW,
                     hf_config.get("max_position_embeddings") or calibrate.WINDOW)
        fitted = calibrate.fitted_int4(path, dtype, window,
                                       lambda: load_model(name, dtype, device, backend, max_positions, "none"),
                                       cpu_kernels.usable_cpus() if tensor_parallel is not None else None)
    cls = model_class(hf_config)
    positions = max_positions or hf_config.get("max_position_embeddings", 4096)
    if fitted is not None and shard is not None:  # the whole model's fit, each matrix cut as its float values are
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(calibrate.Q4_1)]
        fitted = {name: torch.from_numpy(shard.block_rows(
            f"{name}.weight", blocks.numpy(), (blocks.shape[0], blocks.shape[1] // block_bytes * block), block,
            block_bytes)[0]) for name, blocks in fitted.items()}
    with torch.device("meta"):
        model = cls(hf_config if shard is None else shard.config(hf_config), backend, positions)
        if reader is None and hf_config.get("quantization_config"):  # block-format weights (gpt-oss's MXFP4)
            keep = quantization == "auto" and device.type == "cpu" and shard is None and quant.load() is not None
            quantized = model.packed_weights(hf_config, keep)
        weights = model.checkpoint_weights(weights)
        if shard is not None:
            from tokenmill.distributed import tensor_parallel as tp

            tp.make_shard(model, shard, tensor_parallel[2])
            weights = tp.cut_float_weights(model, shard, weights)
    model.quantize_weights(quantized)
    if torch_int8:
        weights = torch_int8_on_load(model, weights, device)
    elif quantization in quant.QUANTIZE_TO:
        weights = quantize_on_load(model, weights, quantization, fitted)
    elif quantization == "fp8":
        weights = fp8_on_load(model, weights, device)
    if device.type == "cpu":
        # One contiguous, huge-page-backed buffer for the weights (kept for measuring its read speed).
        model.weight_arena = arena.materialize(model, dtype)
    else:
        model = model.to_empty(device=device).to(dtype)
    try:
        model.load_weights(weights)
    except MissingWeights as e:
        if reader is None:
            raise
        names = list(dict.fromkeys(gguf_loader.gguf_name(n, reader.arch) for n in e.names))
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ValueError(f"{os.path.basename(path)} lacks tensor {names[0]!r}{more}: the file is incomplete or "
                         "was not written for this architecture") from None
    # Rotary tables are not weights: build them on the device, kept in float32 for accuracy.
    model.rotaries = model.make_rotaries(positions).to(device)
    model.eval()
    release_freed_heap()  # what parsing and repacking the file used and freed (~20 MiB for a 1B GGUF)
    elapsed = time.perf_counter() - start
    qweights = quantized_weights(model)
    n_params = sum(p.numel() for p in model.parameters()) + sum(w.shape[0] * w.shape[1] for w in qweights)
    formats = sorted({w.name for w in qweights})
    kind = str(dtype).removeprefix("torch.") + (f" and {'/'.join(formats)}" if formats else "")
    logger.info("loaded %s (%s, %.1fM parameters, %s; weights %.1f MiB) in %.2f s",
                os.path.basename(path.rstrip("/")), hf_config["architectures"][0], n_params / 1e6, kind,
                weight_bytes(model) / 2**20, elapsed)
    return LoadedModel(model, hf_config, tokenizer, generation_config, path, elapsed, gguf_sampling,
                       named_model_at(path))


def _shard(hf_config: dict, tensor_parallel, granule: int = 32):
    """The Shard of (rank, world, group), or None."""
    if tensor_parallel is None:
        return None
    from tokenmill.distributed.shard import Shard

    rank, world, _ = tensor_parallel
    return Shard.of(hf_config, rank, world, granule)


def quantize_on_load(model: nn.Module, weights, quantization: str, fitted: dict | None = None):
    """Prepare the model's linear layers and embedding for int8 / int4 weights, and quantize their float
    checkpoint tensors as they stream past (the float copy is never kept), mixture-of-experts experts
    included (each expert's matrices in the linear layers' format). Layers whose rows do not divide into
    groups of 32 stay float, as do mixture-of-experts routers (keep_float: their top-k choice is discrete).
    fitted: blocks already chosen for some layers (calibrate.py), by module name; their checkpoint
    tensors are replaced by them."""
    from tokenmill.model.layers import Embedding, takes_blocks
    from tokenmill.model.moe import Experts

    linear_type, edge_type = quant.QUANTIZE_TO[quantization]
    if quant.load() is None:
        raise ValueError(f"quantization {quantization!r} needs the quantized-weight kernels, which could not be "
                         "built here (a C++ compiler is required)")
    targets = {}
    for name, module in model.named_modules():
        if takes_blocks(module):
            if fitted is not None and name in fitted:
                targets[name] = _fitted_blocks(model, module, fitted[name], linear_type)
            else:
                targets[name] = _to_blocks(edge_type if isinstance(module, Embedding) or name == "lm_head"
                                           else linear_type)
            module.quantize_weight()
        elif isinstance(module, Experts) and module.hidden % 32 == 0 and module.intermediate % 32 == 0:
            targets[name] = _to_blocks(linear_type)
            for part in range(3):
                module.quantize_part(part)
    model.quantized = bool(targets)
    describe = (f"{quantization} ({quant.FORMATS[linear_type][0]}; embedding and output layer "
                f"{quant.FORMATS[edge_type][0]})")
    return _quantized_stream(model, weights, targets, describe)


def _to_blocks(qtype: int):
    """A checkpoint tensor [rows, cols] (or experts stacked [E, rows, cols], their rows one after another;
    sliced by expert later) to GGUF blocks of qtype."""
    def quantize(tensor: torch.Tensor, name: str):
        tile_rows = tensor.shape[-2] if tensor.dim() == 3 else None
        return quant.quantize(tensor.reshape(-1, tensor.shape[-1]), qtype, name, tile_rows)
    return quantize


def _fitted_blocks(model: nn.Module, module: nn.Module, blocks: torch.Tensor, qtype: int):
    """A checkpoint tensor of the module (the whole merged projection, or one part of it) -> those rows of
    the blocks fitted for the whole module."""
    def take(tensor: torch.Tensor, name: str):
        rows = tensor.shape[0]
        if tensor.dim() != 2 or tensor.shape[1] != module.in_features:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the calibrated layer")
        first = 0 if rows == blocks.shape[0] else sum(module.out_sizes[:model._weight_module(name)[1]])
        return quant.QuantizedWeight.from_blocks(qtype, (rows, module.in_features), blocks[first:first + rows], name)
    return take


def _channel_targets(model: nn.Module, weight_class, device: torch.device, granule: int) -> dict:
    """The linear layers that take a per-channel weight format (kernels/fp8.py, kernels/int8.py), each
    prepared for it: all but the embedding, the output layer, mixture-of-experts experts and routers, and
    layers whose sizes are not multiples of granule."""
    from tokenmill.model.layers import Embedding, _QuantizableLinear

    def convert(tensor: torch.Tensor, name: str):
        return weight_class.quantize(tensor.to(device), name)

    targets = {}
    for name, module in model.named_modules():
        if (isinstance(module, _QuantizableLinear) and not isinstance(module, Embedding) and name != "lm_head"
                and not getattr(module, "keep_float", False) and module.in_features % granule == 0
                and all(size % granule == 0 for size in module.out_sizes)):
            targets[name] = convert
            module.quantize_weight()
    model.quantized = bool(targets)
    return targets


def fp8_on_load(model: nn.Module, weights, device: torch.device):
    """Prepare the model's linear layers for FP8 weights (kernels/fp8.py) and quantize their float checkpoint
    tensors on the device as they stream past. The embedding, the output layer, mixture-of-experts experts and
    routers, and layers whose sizes are not multiples of 16 (the FP8 product's granule) stay float."""
    from tokenmill.kernels.fp8 import Fp8Weight, scaled_mm_supported

    targets = _channel_targets(model, Fp8Weight, device, 16)
    if device.type == "cpu":
        logger.warning("fp8 weights on the CPU run through torch's reference FP8 product, slower than bfloat16: "
                       "the CPU's own formats are quantization 'int8' and 'int4'")
    elif not scaled_mm_supported(device):
        logger.info("torch has no FP8 product on this %s: fp8 weights are dequantized for each product", device)
    return _quantized_stream(model, weights, targets,
                             "fp8 (e4m3, a scale per channel; embedding and output layer float)")


def torch_int8_on_load(model: nn.Module, weights, device: torch.device):
    """Quantization "int8" where tokenmill's CPU kernels do not run it (a GPU, or a CPU they could not be
    built for): the linear layers' weights as int8 with a scale per output channel (kernels/int8.py),
    quantized on the device as they stream past, multiplied by torch's weight-only int8 product. The
    embedding, the output layer, mixture-of-experts experts and routers stay float."""
    from tokenmill.kernels.int8 import Int8Weight, int8_product_supported

    targets = _channel_targets(model, Int8Weight, device, 1)
    if not int8_product_supported(device):
        logger.info("torch has no weight-only int8 product on this %s: int8 weights are dequantized for each "
                    "product", device)
    return _quantized_stream(model, weights, targets,
                             "int8 (a scale per channel; embedding and output layer float)")


def _quantized_stream(model: nn.Module, weights, targets: dict, describe: str):
    """The checkpoint's (name, tensor) pairs, each float weight of a module in targets replaced by
    targets[module](tensor, name) as it streams past (the float copy is never kept)."""
    start, before, after, count = time.perf_counter(), 0, 0, 0
    for name, tensor in weights:
        module_name = model._weight_module(name)[0] if name.endswith(".weight") else None
        if module_name in targets and isinstance(tensor, torch.Tensor):
            before += tensor.numel() * model.norm.weight.element_size()
            tensor = targets[module_name](tensor, name)
            after += tensor.nbytes
            count += 1
        yield name, tensor
    logger.info("quantized %d weights to %s in %.2f s: %.1f MiB -> %.1f MiB", count, describe,
                time.perf_counter() - start, before / 2**20, after / 2**20)


def quantized_weights(model: nn.Module) -> list:
    """Every QuantizedWeight the model's layers hold."""
    return [w for m in model.modules() for w in getattr(m, "qparts", ())]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights resident: float parameters plus quantized blocks."""
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(w.nbytes for w in quantized_weights(model)))


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
    """The file's tokenizer as transformers converts it, where tokenmill's own table has no entry for it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:  # the conversion's own errors name no file
        raise ValueError(f"{path}: could not build the file's tokenizer (tokenmill has no table entry for it, and "
                         f"transformers' GGUF conversion failed: {type(e).__name__}: {e})") from e
