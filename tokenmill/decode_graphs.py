"""Decode-only forward passes replayed from CUDA graphs.

On a GPU a decode step of a small model is a few hundred small kernels (about thirty per layer), each
finished long before the CPU has launched the next, so the step costs the launches, not the GPU's time.
A CUDA graph records the whole forward once and replays it with one launch. Graphs have fixed shapes, so
each is recorded for a bucket: a batch size (the step's batch rounded up to the next power of two) and a
block-table width (the widest request's blocks rounded up likewise). Rows past the real batch decode a
dummy token: they write their K/V to a scratch slot no request owns and attend to one token. Columns past
a request's blocks are masked by its length. All buckets share one set of input buffers and one memory
pool; a bucket's graph is recorded the first time a step needs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionMetadata

logger = logging.getLogger("tokenmill")

MAX_BATCH = 256


def _pow2_at_least(n: int, low: int, high: int) -> int:
    b = low
    while b < n:
        b *= 2
    return min(b, high)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor | None  # the graph's output [batch, hidden], overwritten by each replay
    run: object  # the eager forward over the buffers (replayed instead where graphs are off)


class DecodeGraphs:
    """capture=False runs the same padded forward eagerly over the same buffers (where no GPU is present,
    to check the padding)."""

    def __init__(self, model, kv_caches: list, block_size: int, max_blocks: int, scratch_slot: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_blocks, self.scratch_slot, self.device, self.capture = max_blocks, scratch_slot, device, capture
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(MAX_BATCH, **long)
        self.positions = torch.zeros(MAX_BATCH, **long)
        self.slot_mapping = torch.full((MAX_BATCH,), scratch_slot, **long)
        self.block_tables = torch.zeros(MAX_BATCH, max_blocks, **long)
        self.seq_lens = torch.ones(MAX_BATCH, **long)
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return sum(e.graph is not None for e in self._entries.values())

    def bucket(self, batch: int, width: int) -> tuple[int, int] | None:
        """(padded batch, padded block-table width), or None where the step is too large for a graph."""
        if batch > MAX_BATCH or width > self.max_blocks:
            return None
        return _pow2_at_least(batch, 1, MAX_BATCH), _pow2_at_least(width, 16, self.max_blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [batch, hidden] of a decode-only step (one token per request), or None where no
        bucket holds it. The K/V of the new tokens are written to the cache as by the model's forward."""
        n, width = block_tables.shape
        key = self.bucket(n, width)
        if key is None:
            return None
        entry = self._entries.get(key) or self._record(*key)
        b, _ = key
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(self.scratch_slot)  # rows left by a larger batch must not write
        self.block_tables[:n, :width].copy_(block_tables)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].fill_(1)
        if entry.graph is not None:
            entry.graph.replay()
            return entry.hidden[:n]
        return entry.run()[:n]

    def _record(self, b: int, w: int) -> _Entry:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=list(range(b + 1)), seq_lens=[1] * b,
            num_decodes=b, decode_block_tables=self.block_tables[:b, :w], decode_seq_lens=self.seq_lens[:b],
            block_tables=[None] * b, block_size=self.block_size)

        def run() -> torch.Tensor:
            meta.cache.clear()  # gather indices and masks are recomputed from the buffers on each run
            return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)

        if not self.capture:
            entry = _Entry(None, None, run)
        else:
            # Recorded over harmless inputs: every row writes the scratch slot and reads one token.
            self.slot_mapping[:b].fill_(self.scratch_slot)
            self.seq_lens[:b].fill_(1)
            self.block_tables[:b, :w].zero_()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # lazy initialisations (cuBLAS handles, workspaces) happen outside the graph
                    run()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = run()
            self._pool = graph.pool()
            entry = _Entry(graph, hidden, run)
            logger.debug("recorded the decode graph for batch %d, %d blocks", b, w)
        self._entries[(b, w)] = entry
        return entry
