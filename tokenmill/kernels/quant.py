"""Quantized weights: a linear layer's matrix kept in a GGUF block format and multiplied in that format.

QuantizedWeight is the weight-format seam of the linear layers: a matrix [N, K] stored as N rows of
blocks (quant.h), exactly the bytes a GGUF file holds. Its products go through quant_kernels.cpp
(AVX-512 BW where the CPU has it, the same code through SIMDe on AVX2 CPUs, portable C++ elsewhere), compiled on first use and cached by torch
per machine. Where no compiler is available the loader dequantizes instead (and says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading

import torch

logger = logging.getLogger("tokenmill")

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_DIR, name) for name in ("quant_kernels.cpp", "quant.h", "quant_fit.h", "quant_lowbit.h",
                                                  "quant_product.h", "quant_amx.h", "quant_tiles.h", "quant_pairs.h",
                                                  "simd.h")]

# GGML type id -> (name, elements per block, bytes per block), for the types with a kernel.
FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
           10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
           14: ("Q6_K", 256, 210), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17)}

# A type id with this flag: the matrix's rows are interleaved by 16 (quant_tiles.h), the layout of the byte
# products of a few input rows where the CPU has AVX-512 VNNI. TOKENMILL_QUANT_TILES=0 keeps every matrix in
# the row layout (to compare the two).
TILED = 256
_TILE_FORMATS = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)  # Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS
_tiles = os.environ.get("TOKENMILL_QUANT_TILES", "1") != "0"

_module = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build(portable: bool = False):
    """Compiles the kernels for this CPU (-march=native), or, portable=True, without any vector extension
    beyond the x86-64 baseline (the path CPUs with neither AVX-512 BW nor AVX2 take; built so it can be
    tested)."""
    digest = hashlib.sha256()
    for path in _SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    # -march=native: the build is for this CPU, so the name carries its flags as well as the sources.
    from tokenmill.kernels.cpu import compile_kernels, simd_cflags

    simd = [] if portable else (simd_cflags() or [])  # SIMDe's flags on AVX2 CPUs
    digest.update(b"portable" if portable else (_cpu_flags() + " ".join(simd)).encode())
    arch = "-march=x86-64" if portable and platform.machine() in ("x86_64", "AMD64") else "-march=native"
    return compile_kernels(
        f"tokenmill_quant_kernels_{digest.hexdigest()[:12]}", sources=[_SOURCES[0]],
        extra_cflags=["-O3", arch, "-fopenmp", *simd], extra_ldflags=["-fopenmp"], verbose=False)


def load():
    """The compiled quantized-product module, or None where it cannot be built (reason logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    try:
        _module = build()
    except Exception as e:  # no compiler or headers
        logger.warning("could not build the quantized-weight kernels (%s)", str(e).splitlines()[0])
        _module = None
    else:
        _apply_float_rows(_module)
        if not _module.vectorized:
            logger.info("quantized-weight kernels built without AVX-512 BW or AVX2: using their portable C++ path")
    return _module


_float_rows: int | None = None  # set_float_rows' value, for kernel modules loaded after it


def set_float_rows(rows: int) -> None:
    """From how many input rows on a product multiplies float inputs by its dequantized weights (below: int8
    inputs and integer dot products), for float32 and bfloat16 inputs alike; 0 restores the defaults (48
    rows; for bfloat16 inputs 20 on CPUs with AVX-512 BF16). Both kernel modules take it, now or when they
    load."""
    global _float_rows
    from tokenmill.kernels import cpu

    _float_rows = int(rows)
    for module in (_module, cpu._module):
        if module is not None:
            module.set_float_rows(_float_rows)


def _apply_float_rows(module) -> None:
    """Into a freshly loaded kernel module: set_float_rows' value, else TOKENMILL_QUANT_FLOAT_ROWS where set
    (a bad value is said and left out, not fatal)."""
    rows, value = _float_rows, os.environ.get("TOKENMILL_QUANT_FLOAT_ROWS")
    if rows is None and value:
        try:
            rows = int(value)
        except ValueError:
            logger.warning("TOKENMILL_QUANT_FLOAT_ROWS=%r is not a whole number: ignored", value)
    if rows is not None:
        module.set_float_rows(rows)


# A prompt's rows take float inputs whatever their count: a prompt's logits are then those of the dequantized
# model, and do not depend on how much of it the prefix cache held or how it was split into chunks (the part
# computed can be a few rows, which the count alone would send to the int8 path). Decode rows, speculative
# verify rows and rows recomputed after a preemption follow the count (set_float_rows).
# TOKENMILL_QUANT_FLOAT_PROMPTS=0 sends them by the count too (to compare the two).
_prompts_float = os.environ.get("TOKENMILL_QUANT_FLOAT_PROMPTS", "1") != "0"
_step = threading.local()  # the model step running on this thread: (its rows, the first of its prompt rows)


def set_float_prompts(on: bool) -> None:
    """Whether a prompt's rows take float inputs whatever their count (the default), or follow the count as
    other rows do (to compare schedules on the int8 path alone)."""
    global _prompts_float
    _prompts_float = bool(on)


@contextlib.contextmanager
def prompt_rows(rows: int, first: int):
    """Within: the model step on this thread has `rows` rows, those from `first` on a prompt's (the engine
    lays them out last). Products over the step's rows (float_from) take float inputs for those."""
    held = getattr(_step, "rows", None)
    _step.rows = (rows, first) if _prompts_float and first < rows else None
    try:
        yield
    finally:
        _step.rows = held


def float_from(rows: int) -> int | None:
    """For a product over `rows` rows: the first of them that takes float inputs, where they are the running
    step's rows and it has prompt rows; else None."""
    step = getattr(_step, "rows", None)
    return step[1] if step is not None and step[0] == rows else None


def set_tiles(on: bool) -> None:
    """Whether matrices loaded from now on may have their rows interleaved by 16 (the default), or all keep
    the row layout."""
    global _tiles
    _tiles = bool(on)


def tiles_for(qtype: int, rows: int) -> bool:
    """Whether a matrix of `rows` rows in GGUF format `qtype` is stored in tiles of 16 rows: where its format
    has a tile kernel, its rows are whole tiles, and the kernels take AVX-512 VNNI."""
    m = load()
    return _tiles and qtype in _TILE_FORMATS and rows % 16 == 0 and m is not None and m.vnni


def type_name(qtype: int) -> str:
    import gguf

    qtype &= ~TILED
    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


class QuantizedWeight:
    """A matrix [N, K] in a block format: data is uint8 [N, bytes per row], each row's bytes in the kernel's
    layout of its format (quant.h: GGUF's blocks, those of the 32-element formats rearranged), or, where
    qtype has the TILED flag, each 16 rows' bytes interleaved (quant_tiles.h)."""

    __slots__ = ("qtype", "shape", "data")

    def __init__(self, qtype: int, shape: tuple[int, int], data: torch.Tensor, name: str = "weight") -> None:
        base = qtype & ~TILED
        if base not in FORMATS or (qtype & TILED and base not in _TILE_FORMATS):
            raise ValueError(f"{name}: quantized type {type_name(qtype)} has no kernel")
        _, block, nbytes = FORMATS[base]
        n, k = shape
        if qtype & TILED and n % 16:
            raise ValueError(f"{name}: a matrix of rows interleaved by 16 cannot have {n} rows")
        if k % block:
            raise ValueError(f"{name}: rows of {k} elements do not divide into {type_name(qtype)} blocks of {block}")
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, k // block * nbytes):
            raise ValueError(f"{name}: {type_name(qtype)} data of shape {tuple(data.shape)} does not hold a "
                             f"[{n}, {k}] matrix ({k // block * nbytes} bytes per row)")
        self.qtype, self.shape, self.data = qtype, (n, k), data.contiguous()

    @classmethod
    def from_blocks(cls, qtype: int, shape: tuple[int, int], blocks: torch.Tensor, name: str = "weight",
                    out: torch.Tensor | None = None, tile_rows: int | None = None) -> "QuantizedWeight":
        """From rows of GGUF blocks, as a file holds them (checked, then repacked for the kernel into `out`
        where given: a uint8 view of the same shape, e.g. a slice of the weight arena). Tiled where
        tiles_for() says so; tile_rows: the row count each slice taken of it later will have (a stacked
        expert tensor's), which must then be whole tiles too."""
        w = cls(qtype, shape, blocks, name)
        if tiles_for(qtype, shape[0]) and (tile_rows is None or tile_rows % 16 == 0):
            w.qtype = qtype | TILED
        w.data = _module.repack(w.data, w.qtype, shape[1], out)
        return w

    @property
    def name(self) -> str:
        return FORMATS[self.qtype & ~TILED][0]

    @property
    def tiled(self) -> bool:
        return bool(self.qtype & TILED)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor, float_from: int | None = None) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N] in x's dtype. Rows from float_from on (of x's rows, flattened) take
        float inputs whatever their count; the rows before it (all, where None) take the path their count
        chooses."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.shape[1])
        if float_from is None or float_from >= x.shape[0]:
            y = _module.qmatmul(x, self.data, self.qtype, self.shape[1])
        elif float_from <= 0:
            y = _module.qmatmul(x, self.data, self.qtype, self.shape[1], float_inputs=True)
        else:
            y = torch.cat([_module.qmatmul(x[:float_from], self.data, self.qtype, self.shape[1]),
                           _module.qmatmul(x[float_from:], self.data, self.qtype, self.shape[1], float_inputs=True)])
        return y.view(*lead, self.shape[0])

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 values of rows `ids` (all rows by default)."""
        ids = torch.empty(0, dtype=torch.int64) if ids is None else ids.reshape(-1)
        return _module.dequantize(self.data, self.qtype, self.shape[1], ids)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """The row-wise concatenation of matrices of one type and row length."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only matrices of one type and row length concatenate")
        shape = (sum(p.shape[0] for p in parts), first.shape[1])
        row_bytes = first.data.shape[1]
        base = first.data
        adjacent = all(p.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in parts) and \
            all(b.data.data_ptr() == a.data.data_ptr() + a.data.numel() for a, b in zip(parts, parts[1:]))
        if adjacent:  # parts laid out one after another (the loader's arena): a view, no copy
            data = base.as_strided((shape[0], row_bytes), (row_bytes, 1))
        else:
            data = torch.cat([p.data for p in parts])
        return QuantizedWeight(first.qtype, shape, data)


# quantization= name -> (format of the linear layers, format of the embedding and output layer). The
# embedding and output layer stay at 8 bits in int4 mode, as llama.cpp's 4-bit mixes keep them at 6-8.
QUANTIZE_TO = {"int8": (8, 8), "int4": (3, 8), "int4-gptq": (3, 8)}


def _affine_codes(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor, top: int) -> torch.Tensor:
    """g's codes (float) on the grid d q + m, q in 0..top, rounded to nearest (all 0 where d is 0)."""
    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros((), dtype=torch.float32))
    return ((g - m.float()) * inv).round().clamp(0, top)


def _fit_affine(g: torch.Tensor, top: int, iterations: int = 4, importance: torch.Tensor | None = None,
                search: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale d and offset m (float16, as stored) of each group of g [..., n] on the grid w ~ d q + m,
    q in 0..top, with the least squared error found: from the group's range, then alternately rounding q
    and refitting d and m by least squares. The range's own grid is kept where nothing beats it (weights
    that already lie on such a grid keep it exactly). importance [n] (positive): each element's weight in
    the squared error (by default all 1). search: also start from the codes of `search` grids over the
    range with from top - 1 to top + 1 steps, each refitted, and go on from the best (quant_fit.h). Also
    returns the codes of g on the grids found (uint8, g's shape), as `_affine_codes` gives them."""
    n = g.shape[-1]
    steps = torch.linspace(top - 1, top + 1, search) if search else torch.empty(0)
    weights = torch.empty(0) if importance is None else importance.reshape(n)
    module = load()  # (GPTQ runs on a float model, which loads no quantized product before)
    if module is None:
        raise RuntimeError("fitting int4 grids needs the quantized-weight kernels, which could not be built here")
    d, m, codes = module.fit_affine(g.reshape(-1, n), top, iterations, weights, steps)
    return d.view(*g.shape[:-1], 1), m.view(*g.shape[:-1], 1), codes.view(g.shape)


def quantize(w: torch.Tensor, qtype: int, name: str = "weight", tile_rows: int | None = None) -> QuantizedWeight:
    """A float matrix [N, K] quantized in groups of 32 along K: Q8_0 (int8, w = d q with d = max|w| / 127,
    rounded to nearest) or Q4_1 (int4, w = d q + m, d and m fitted to the group by least squares from the
    best of 11 starting grids, `_fit_affine`)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"{name}: rows of {k} elements do not divide into groups of 32")
    g = w.detach().float().reshape(n, k // 32, 32)
    if qtype == 8:
        d = (g.abs().amax(-1, keepdim=True) / 127).half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros((), dtype=torch.float32))
        q = (g * inv).round().clamp(-127, 127).to(torch.int8)
        blocks = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)
    elif qtype == 3:
        blocks = _q4_1_blocks(*_fit_affine(g, 15, search=11))
    else:
        raise ValueError(f"quantizing to {type_name(qtype)} is not supported (Q8_0 and Q4_1 are)")
    return QuantizedWeight.from_blocks(qtype, (n, k), blocks.reshape(n, -1).contiguous(), name, tile_rows=tile_rows)


def _q4_1_blocks(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks [N, K/32, 20] from each group's scale and offset [N, K/32, 1] (float16) and codes
    [N, K/32, 32] (0..15)."""
    n, groups = q.shape[:2]
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # GGUF's order: element j low, j + 16 high
    return torch.cat([d.view(torch.uint8).reshape(n, groups, 2), m.view(torch.uint8).reshape(n, groups, 2), packed],
                     dim=-1)


def gptq_q4_1(w: torch.Tensor, hessian: torch.Tensor, name: str = "weight", damp: float = 0.01,
              block: int = 128) -> torch.Tensor:
    """Q4_1 blocks [N, K/32 * 20] of a float matrix w [N, K] fitted to the inputs it multiplies (GPTQ,
    Frantar et al. 2022): hessian [K, K] is the sum of x x^T over calibration inputs x of the layer.

    The columns are rounded in order, and each column's rounding error is spread over the columns not yet
    rounded, weighted by the inverse Hessian, so that the layer's outputs on such inputs move the least.
    Each group of 32 gets its grid (`_fit_affine`, searching 11 starting grids) from its weights as they
    stand when the group is reached, each weight's squared error there weighted by its input's mean square
    (the Hessian's diagonal): on Gemma 3 270M that weighting halves what GPTQ with unweighted grids loses
    (docs/benchmarks.md). Rows are independent: a merged projection's parts get the same blocks quantized
    together or apart."""
    n, k = w.shape
    if k % 32 or block % 32:
        raise ValueError(f"{name}: rows of {k} elements do not divide into groups of 32")
    if hessian.shape != (k, k):
        raise ValueError(f"{name}: a Hessian of shape {tuple(hessian.shape)} for rows of {k} elements")
    W = w.detach().float().clone()
    H = hessian.detach().float().clone()
    diag = H.diagonal()
    importance = diag.clamp(min=diag.mean() * 1e-6 + 1e-30)  # (inputs never seen: a token weight, not none)
    diag[diag == 0] = 1  # such inputs' columns are rounded alone: nothing spreads to or from them
    diag.add_(damp * diag.mean())
    try:
        L = torch.linalg.cholesky(H)
    except torch.linalg.LinAlgError:  # numerically indefinite: more damping
        diag.add_(diag.mean())
        L = torch.linalg.cholesky(H)
    U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # H^-1 = U^T U
    d = torch.empty(n, k // 32, 1, dtype=torch.float16)
    m = torch.empty_like(d)
    codes = torch.empty(n, k)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, E1, U1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1), U[i1:i2, i1:i2]
        for j in range(i2 - i1):
            c = i1 + j
            if c % 32 == 0:
                gd, gm, _ = _fit_affine(W1[:, j:j + 32], 15, importance=importance[c:c + 32], search=11)
                d[:, c // 32], m[:, c // 32] = gd, gm
                df, mf = gd.float()[:, 0], gm.float()[:, 0]
            col = W1[:, j]
            q = _affine_codes(col.unsqueeze(1), gd, gm, 15)[:, 0]
            codes[:, c] = q
            err = (col - (q * df + mf)) / U1[j, j]
            W1[:, j:].sub_(err.unsqueeze(1) * U1[j, j:].unsqueeze(0))
            E1[:, j] = err
        W[:, i2:].sub_(E1 @ U[i1:i2, i2:])
    return _q4_1_blocks(d, m, codes.view(n, k // 32, 32)).reshape(n, -1).contiguous()
