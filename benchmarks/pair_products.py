"""A prompt chunk's product with a quantized matrix (bfloat16 inputs) three ways, in one process, alternated:
torch's bfloat16 GEMM on a bfloat16 matrix of the same shape (the BF16 file's product), the row layout's
dequantized copy and torch's GEMM, and the tiles' pair products (kernels/quant_pairs.h); and, for
comparison, the tiles' int8 products (the path of decode rows below the float-rows switch, taken here
whatever the count). Random blocks;
a 1B Llama's shapes (hidden 2048, MLP 8192; Q4_K, Q6_K and Q4_0 as its Q4_K_M and Q4_0 files hold them),
Gemma 3 270M's Q8_0 MLP and the default model's Q4_1 MLP. Prints milliseconds for the bfloat16 GEMM and
the others' time as a multiple of it (medians of alternated rounds).

    python benchmarks/pair_products.py [--rows 16 64 256 512] [--threads 2] [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (label, format, rows N, row length K)
SHAPES = [("1B ffn_gate", "Q4_K", 8192, 2048), ("1B ffn_down", "Q6_K", 2048, 8192), ("1B ffn_gate", "Q4_0", 8192, 2048),
          ("Gemma ffn_up", "Q8_0", 2048, 640), ("default ffn_up", "Q4_1", 1536, 576)]


def random_blocks(qtype: str, n: int, k: int, rng):
    """Valid blocks of the gguf package's format `qtype`: random bytes, the float16 scales moderate."""
    import gguf
    import numpy as np

    t = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    data = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    if qtype in ("Q6_K", "Q3_K", "Q2_K"):  # d last (Q2_K: d, dmin)
        halves = 2 if qtype == "Q2_K" else 1
        data[..., -2 * halves:] = rng.uniform(1e-4, 2e-3, (n, k // block, halves)).astype(np.float16).view(np.uint8)
    else:  # d (and the offset or dmin) first
        halves = 2 if qtype in ("Q4_1", "Q4_K") else 1
        data[..., :2 * halves] = rng.uniform(1e-4, 2e-3, (n, k // block, halves)).astype(np.float16).view(np.uint8)
    return int(t), data.reshape(n, -1)


def main() -> None:
    import numpy as np
    import torch

    from tokenmill.kernels import quant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512], help="input rows (a prompt chunk)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="per row count: seconds of alternated rounds")
    args = ap.parse_args()
    m = quant.load()
    if m is None or not quant.tiles_for(8, 16):
        sys.exit("needs the kernels' tiles (AVX-512 VNNI without AMX)")
    torch.set_num_threads(args.threads)
    quant.set_float_rows(1 << 20)  # int8 products whatever the count (float_inputs=True still sends rows to floats)
    rng = np.random.default_rng(0)
    print(f"{'matrix':16s} {'format':6s} {'rows':>5s}  bf16 GEMM    row layout, dequantized   tiles, pair products"
          "   tiles, int8 products")
    for name, qtype, n, k in SHAPES:
        code, data = random_blocks(qtype, n, k, rng)
        rows = m.repack(torch.from_numpy(data), code, k)
        tiles = m.repack(torch.from_numpy(data), code | quant.TILED, k)
        dense = torch.randn(n, k).bfloat16()
        for count in args.rows:
            x = torch.randn(count, k).bfloat16()
            runs = {"bf16": lambda: torch.nn.functional.linear(x, dense),
                    "rows": lambda: m.qmatmul(x, rows, code, k, float_inputs=True),
                    "pairs": lambda: m.qmatmul(x, tiles, code | quant.TILED, k, float_inputs=True),
                    "int8": lambda: m.qmatmul(x, tiles, code | quant.TILED, k)}
            for run in runs.values():
                run(), run()
            times = {key: [] for key in runs}
            end = time.time() + args.seconds
            while time.time() < end or len(times["bf16"]) < 3:
                for key in random.sample(list(runs), len(runs)):
                    start = time.perf_counter()
                    runs[key]()
                    times[key].append(time.perf_counter() - start)
            med = {key: statistics.median(v) for key, v in times.items()}
            print(f"{name:16s} {qtype:6s} {count:5d}  {med['bf16'] * 1e3:7.2f} ms   {med['rows'] / med['bf16']:10.2f}x"
                  f"                {med['pairs'] / med['bf16']:10.2f}x            {med['int8'] / med['bf16']:10.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
