"""Weight bytes per second of one block-format product at batch 1 (the decode GEMV), on 1 and 2 threads:
one tensor of a GGUF file, repacked as tokenmill loads it, multiplied by a random bfloat16 row. With --rows
a smaller slice of it (e.g. 1024 rows: in cache), otherwise the whole matrix (from memory, if it is larger
than the caches). Shows whether a format's kernel is bound by its instructions or by memory. With --inputs M,
M input rows at once (a batched decode step's GEMV, up to the row count where AMX tiles take over).

    python benchmarks/quant_product_rate.py FILE.gguf TENSOR [--rows N] [--inputs M] [--threads 1,2]
    python benchmarks/quant_product_rate.py M/model-Q4_K_M.gguf blk.0.ffn_gate.weight
    python benchmarks/quant_product_rate.py FILE.gguf TENSOR --base REV [--inputs 1,4,8] [--seconds 10]

With --base, the kernels as they were at git revision REV and the working tree's, built for this CPU and
loaded side by side in this process, each product timed with one and then the other in random order for
--seconds per input-row count (one thread): the median of the per-round ratios, new over base. The two
builds must give the same bits (checked). With --prompt, a prompt chunk's product instead (bfloat16 inputs
taking the float path whatever their count, as the engine sends a prompt's rows), on --threads' first count;
the two builds' outputs must then agree to bfloat16's rounding (their sums may run in other orders).

    python benchmarks/quant_product_rate.py M/model-Q4_K_M.gguf blk.0.ffn_gate.weight --base REV --prompt \
        --inputs 4,16,64,256,512 --threads 2 --seconds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    import torch

    from tokenmill.kernels import quant

    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("tensor")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--inputs", default="1", help="input rows (with --base: a comma-separated list)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--base", default=None, help="git revision of the kernels to compare against (in-process A/B)")
    ap.add_argument("--seconds", type=float, default=10.0, help="with --base: seconds of rounds per input-row count")
    ap.add_argument("--prompt", action="store_true", help="with --base: a prompt chunk's product (bfloat16, float path)")
    args = ap.parse_args()
    quant.load()
    if args.base:
        return compare(args)
    w = load_tensor(args.file, args.tensor, args.rows)
    rows, k = w.shape
    x = torch.randn(int(args.inputs), k).bfloat16()
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


def load_tensor(path: str, name: str, rows: int | None):
    """The tensor's repacked weight (its first `rows` rows, or all), as tokenmill loads it."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    from tokenmill.kernels import quant

    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    n, k = int(t.shape[1]), int(t.shape[0])
    rows = min(rows or n, n)
    blocks = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(n, -1)[:rows].clone()
    return quant.QuantizedWeight.from_blocks(int(t.tensor_type), (rows, k), blocks)


def compare(args) -> None:
    """--base: the product with the base revision's kernels and the working tree's, alternated in-process."""
    import random

    import torch
    from kernel_ab import kernel_sources_at

    from tokenmill.kernels import quant

    new = quant.load()
    base_dir = kernel_sources_at(args.base, [os.path.basename(p) for p in quant._SOURCES])
    sources = quant._SOURCES
    quant._SOURCES = [os.path.join(base_dir, os.path.basename(p)) for p in sources]
    try:
        base = quant.build()
    finally:
        quant._SOURCES = sources
    threads = int(args.threads.split(",")[0]) if args.prompt else 1
    torch.set_num_threads(threads)
    w = load_tensor(args.file, args.tensor, args.rows)
    k = w.shape[1]
    for m in (int(v) for v in str(args.inputs).split(",")):
        x = torch.randn(m, k).bfloat16() if args.prompt else torch.randn(m, k)
        a = base.qmatmul(x, w.data, w.qtype, k, float_inputs=args.prompt)
        b = new.qmatmul(x, w.data, w.qtype, k, float_inputs=args.prompt)
        if args.prompt:  # a bfloat16 step (2^-8 of the value) at most, past sums' own rounding
            assert ((a.float() - b.float()).abs() <= a.float().abs() / 128 + 1e-3 * a.float().abs().max()).all(), \
                "the builds differ by more than rounding"
        else:
            assert torch.equal(a, b), "the builds differ"
        reps = 20 if m < 64 else 3

        def run(module) -> float:
            start = time.perf_counter()
            for _ in range(reps):
                module.qmatmul(x, w.data, w.qtype, k, float_inputs=args.prompt)
            return (time.perf_counter() - start) / reps

        for _ in range(5):
            run(base), run(new)
        times = {"base": [], "new": []}
        end = time.time() + args.seconds
        while time.time() < end:
            for name in random.sample(["base", "new"], 2):
                times[name].append(run(base if name == "base" else new))
        ratio = statistics.median(b / a for a, b in zip(times["base"], times["new"]))
        print(f"{w.name} {w.shape[0]} x {k}, {m} input row(s), {threads} thread(s): base {statistics.median(times['base']) * 1e6:.1f} us, "
              f"new {statistics.median(times['new']) * 1e6:.1f} us, new/base {ratio:.3f} ({len(times['base'])} rounds)")


if __name__ == "__main__":
    main()
