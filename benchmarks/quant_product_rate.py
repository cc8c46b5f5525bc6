"""Weight bytes per second of one block-format product at batch 1 (the decode GEMV), on 1 and 2 threads:
one tensor of a GGUF file, repacked as tokenmill loads it, multiplied by a random bfloat16 row. With --rows
a smaller slice of it (e.g. 1024 rows: in cache), otherwise the whole matrix (from memory, if it is larger
than the caches). Shows whether a format's kernel is bound by its instructions or by memory. With --inputs M,
M input rows at once (a batched decode step's GEMV, up to the row count where AMX tiles take over).

    python benchmarks/quant_product_rate.py FILE.gguf TENSOR [--rows N] [--inputs M] [--threads 1,2]
    python benchmarks/quant_product_rate.py M/model-Q4_K_M.gguf blk.0.ffn_gate.weight
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    import numpy as np
    import torch
    from gguf import GGUFReader

    from tokenmill.kernels import quant

    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("tensor")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--inputs", type=int, default=1)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    quant.load()
    t = next(t for t in GGUFReader(args.file).tensors if t.name == args.tensor)
    n, k = int(t.shape[1]), int(t.shape[0])
    rows = min(args.rows or n, n)
    blocks = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(n, -1)[:rows].clone()
    w = quant.QuantizedWeight.from_blocks(int(t.tensor_type), (rows, k), blocks)
    x = torch.randn(args.inputs, k).bfloat16()
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for _ in range(20):
            w.matmul(x)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for _ in range(50):
                w.matmul(x)
            times.append((time.perf_counter() - start) / 50)
        best = statistics.median(times)
        print(f"{w.name} {rows} x {k}, {args.inputs} input row(s), {threads} thread(s): {best * 1e6:.0f} us a product, "
              f"{w.nbytes / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
