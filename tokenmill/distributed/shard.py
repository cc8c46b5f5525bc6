"""A tensor-parallel rank's slice of a model: which rows and columns of each weight it keeps.

Megatron's split, as vLLM makes it:
- column-parallel (each rank a slice of the output rows): q, k and v by heads, gate and up by intermediate
  rows, each expert's gate and up likewise;
- row-parallel (each rank a slice of the input columns, partial sums added over the ranks): o and down,
  each expert's down; their bias stays on rank 0 only, so the sum holds it once;
- attention sinks (gpt-oss) by query heads, as q;
- vocab-parallel: the embedding and the output layer, rows cut in slices of ceil(vocab / world);
- everything else (norms, the router, q/k norms) whole on every rank.

The cut happens on the checkpoint's tensors as they stream in, before anything is materialized; a block-format
(GGUF) matrix is cut in its blocks, so a rank holds the file's bytes of its slice and nothing else.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.model.moe import EXPERT_WEIGHT

_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "i", "up_proj": "i"}
_MERGED = {"qkv_proj": ("q", "kv", "kv"), "gate_up_proj": ("i", "i")}
_ROW = {"o_proj": "q", "down_proj": "i"}
_VOCAB = {"embed_tokens", "lm_head"}
_LAYER = re.compile(r"layers\.\d+\.")


@dataclass(frozen=True, slots=True)
class Cut:
    """What a rank keeps of a matrix [rows, cols] (or a vector [rows]): the row ranges, in order, and the
    column range (None: all); zero: a bias that only rank 0 adds."""

    rows: tuple[tuple[int, int], ...] | None
    cols: tuple[int, int] | None = None
    zero: bool = False


def _even(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's range of n units split as evenly as whole units allow."""
    return n * rank // world, n * (rank + 1) // world


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `world` tensor-parallel ranks, for a model of the given (whole) sizes.

    Attention splits by key/value head, each with its group of query heads, so a model whose heads do not
    divide by world still splits (SmolLM2-135M's 3 KV heads over 2 ranks: 1 and 2). The MLP's rows split in
    units of `granule` (32, the fused decode step's; 256 where the file's down projection is in a K format,
    whose blocks a cut must not split) where the size allows, evenly. (Giving a rank with fewer heads more MLP
    rows evens out the layer's total but not its two halves: each sum waits for the slowest rank, so the rank
    with more heads would wait after the MLP as the other waits after attention. Measured: slower.)"""

    rank: int
    world: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    expert_intermediate: int
    shared_intermediate: int
    vocab: int
    granule: int = 32

    @classmethod
    def of(cls, hf_config: dict, rank: int, world: int, granule: int = 32) -> "Shard":
        """The shard of a model described by its (whole) HF config; refuses one with fewer KV heads than ranks."""
        c = hf_config
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        if kv < world:
            raise ValueError(f"tensor_parallel_size {world} exceeds the model's {kv} key/value heads: each rank "
                             "holds at least one")
        return cls(rank, world, heads, kv, c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"],
                   c.get("moe_intermediate_size") or c["intermediate_size"],
                   c.get("shared_expert_intermediate_size") or 0, c["vocab_size"], granule)

    @property
    def vocab_slice(self) -> int:
        return -(-self.vocab // self.world)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The rows of the embedding and output layer this rank holds."""
        start = self.rank * self.vocab_slice
        return start, min(start + self.vocab_slice, self.vocab)

    def _unit(self, n: int) -> int:
        for unit in (self.granule, 32):
            if n % unit == 0 and n // unit >= self.world:
                return unit
        return 1

    def _rows(self, n: int) -> tuple[int, int]:
        """This rank's rows of an intermediate size n, in whole units, evenly."""
        unit = self._unit(n)
        a, b = _even(n // unit, self.rank, self.world)
        return a * unit, b * unit

    def rank_sizes(self) -> list[tuple[int, int]]:
        """Every rank's (query rows, MLP rows): a path that not every rank's shard can take is taken by none."""
        sizes = []
        for rank in range(self.world):
            other = dataclasses.replace(self, rank=rank)
            q0, q1 = other._part("q")
            i0, i1 = other._part("i")
            sizes.append((q1 - q0, i1 - i0))
        return sizes

    def _heads(self) -> tuple[int, int]:
        return _even(self.num_kv_heads, self.rank, self.world)

    @property
    def most_kv_heads(self) -> int:
        """The KV heads of the rank that holds the most."""
        return -(-self.num_kv_heads // self.world)

    def config(self, hf_config: dict) -> dict:
        """The HF config of this rank's slice: its heads and intermediate rows (head_dim made explicit, since it
        no longer follows from hidden / heads); the vocabulary stays whole (the engine samples over all of it)."""
        c = copy.deepcopy(hf_config)
        g0, g1 = self._heads()
        c["head_dim"] = self.head_dim
        c["num_attention_heads"] = (g1 - g0) * (self.num_heads // self.num_kv_heads)
        c["num_key_value_heads"] = g1 - g0
        for key, (a, b) in (("intermediate_size", self._rows(self.intermediate)),
                            ("moe_intermediate_size", self._rows(self.expert_intermediate)),
                            ("shared_expert_intermediate_size", self._rows(self.shared_intermediate))):
            if c.get(key):
                c[key] = b - a
        return c

    # ------------------------------------------------------------------ cuts
    def _size(self, unit: str, expert: bool = False, shared: bool = False) -> int:
        """The whole model's rows of a part: q (query), kv (key or value), i (intermediate)."""
        if unit == "i":
            return self.shared_intermediate if shared else self.expert_intermediate if expert else self.intermediate
        return (self.num_heads if unit == "q" else self.num_kv_heads) * self.head_dim

    def _part(self, unit: str, expert: bool = False, shared: bool = False) -> tuple[int, int]:
        """This rank's range of a part's rows (see _size)."""
        if unit == "i":
            return self._rows(self._size(unit, expert, shared))
        g0, g1 = self._heads()
        per = self.head_dim * (self.num_heads // self.num_kv_heads if unit == "q" else 1)
        return g0 * per, g1 * per

    def cut(self, name: str, shape: tuple[int, ...]) -> Cut:
        """What this rank keeps of the checkpoint tensor `name` (HF naming, after the model's own
        canonical_name) of `shape`; experts stacked [E, rows, cols] count as [E * rows, cols]."""
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        bias = parts[-1] == "bias"
        shared = "shared_expert." in name
        expert = EXPERT_WEIGHT.match(name)
        if expert:
            part = expert.group(3)
            rows = shape[0]
            stacked = expert.group(2) is None
            each = self._part("i", expert=True)
            if bias:  # [rows] or [E, rows] (gpt-oss): the rows are the last dimension
                return Cut(None, zero=self.rank > 0) if part == "down_proj" else Cut(None, each)
            if part == "down_proj":
                return Cut(None, each)
            per = self.expert_intermediate
            experts = rows // per if stacked else 1
            return Cut(tuple((e * per + each[0], e * per + each[1]) for e in range(experts)))
        if parts[-1] == "sinks":  # [heads]
            g0, g1 = self._heads()
            group = self.num_heads // self.num_kv_heads
            return Cut(((g0 * group, g1 * group),))
        if module in _VOCAB and not _LAYER.search(name):
            return Cut((self.vocab_range,))
        if module in _COLUMN:
            return Cut((self._part(_COLUMN[module], shared=shared),))
        if module in _MERGED:
            starts, ranges = 0, []
            for unit in _MERGED[module]:
                a, b = self._part(unit, shared=shared)
                ranges.append((starts + a, starts + b))
                starts += self._size(unit, shared=shared)
            return Cut(tuple(ranges))
        if module in _ROW:
            if bias:
                return Cut(None, zero=self.rank > 0)
            return Cut(None, self._part(_ROW[module], shared=shared))
        return Cut(None)

    def float_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a float checkpoint tensor."""
        stacked = t.dim() == 3
        x = t.reshape(-1, t.shape[-1]) if stacked else t
        cut = self.cut(name, tuple(x.shape))
        if cut.zero:
            return torch.zeros_like(t)
        if cut.rows is not None:
            x = torch.cat([x[a:b] for a, b in cut.rows]) if len(cut.rows) > 1 else x[cut.rows[0][0]:cut.rows[0][1]]
        if cut.cols is not None:
            x = x[..., cut.cols[0]:cut.cols[1]]
        if stacked:
            x = x.reshape(t.shape[0], -1, x.shape[-1])
        return x.contiguous()

    def block_rows(self, name: str, rows: np.ndarray, shape: tuple[int, int], block: int,
                   block_bytes: int) -> tuple[np.ndarray, tuple[int, int]]:
        """This rank's part of a block-format matrix: rows [N, bytes per row] of GGUF blocks holding shape
        [N, K]. Columns are cut at block boundaries (quantized_plan keeps only matrices whose cut falls on
        them: splits_blocks)."""
        cut = self.cut(name, shape)
        n, k = shape
        if cut.rows is not None:
            rows = np.concatenate([rows[a:b] for a, b in cut.rows]) if len(cut.rows) > 1 else \
                rows[cut.rows[0][0]:cut.rows[0][1]]
            n = sum(b - a for a, b in cut.rows)
        if cut.cols is not None:
            a, b = cut.cols
            if a % block or b % block:
                raise ValueError(f"{name}: columns [{a}, {b}) do not fall on blocks of {block}")
            rows = rows[:, a // block * block_bytes:b // block * block_bytes]
            k = b - a
        return np.ascontiguousarray(rows), (n, k)

    def splits_blocks(self, name: str, shape: tuple[int, int], block: int) -> bool:
        """Whether this rank's columns of the matrix fall on the block boundaries of its format."""
        cut = self.cut(name, shape)
        return cut.cols is None or (cut.cols[0] % block == 0 and cut.cols[1] % block == 0)
