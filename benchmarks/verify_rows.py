"""What extra query rows cost a decode step of the fused CPU decoder: one row, k+1 rows of one request
(a speculative verify step) and the same number of rows from separate requests, at a short and a long
context. The decoder's forward alone, on the model's own weights and KV cache (whatever the cache
holds: the timing does not depend on its values), medians of 40 calls after 5 warm-up calls, in rounds.

    python benchmarks/verify_rows.py [MODEL] [--contexts 32,700] [--rows 4,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tokenmill import LLM  # noqa: E402


def step_inputs(context: int, rows: int, one_request: bool, block_size: int) -> list[torch.Tensor]:
    """A decode step's inputs: `rows` rows at positions context.. of one request (its block table shared),
    or `rows` requests at position `context`, each with blocks of its own."""
    blocks = (context + rows + block_size) // block_size + 1
    ids, pos, slots, tables, lens = [], [], [], [], []
    for i in range(rows):
        table = list(range(blocks)) if one_request else list(range(i * blocks, (i + 1) * blocks))
        p = context + i if one_request else context
        ids.append(100 + i)
        pos.append(p)
        slots.append(table[p // block_size] * block_size + p % block_size)
        tables.append(table)
        lens.append(p + 1)
    return [torch.tensor(x) for x in (ids, pos, slots, tables, lens)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="32,700")
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    runner = llm.engine.runner
    fused = runner.model._build_fused_decoder(runner.kv_caches, runner.block_size)
    if fused is None:
        sys.exit("the fused decoder does not run this model on this CPU")
    most = max(map(int, args.rows.split(",")))
    if most * ((max(map(int, args.contexts.split(","))) + most) // runner.block_size + 2) > llm.engine.num_blocks:
        sys.exit("the KV cache is too small for these contexts and rows")

    def timed(inputs) -> float:
        for _ in range(5):
            fused.forward(*inputs)
        times = []
        for _ in range(40):
            start = time.perf_counter()
            fused.forward(*inputs)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    for r in range(args.rounds):
        for context in map(int, args.contexts.split(",")):
            parts = [f"1 row {timed(step_inputs(context, 1, True, runner.block_size)):.2f} ms"]
            for rows in map(int, args.rows.split(",")):
                one = timed(step_inputs(context, rows, True, runner.block_size))
                apart = timed(step_inputs(context, rows, False, runner.block_size))
                parts.append(f"{rows} rows one request {one:.2f} / {rows} requests {apart:.2f} ms")
            print(f"round {r + 1}, context {context}: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
