"""K-format matrices (Q4_K, Q5_K, Q6_K; Q2_K, Q3_K, IQ4_XS) in the two layouts of the engine (kernels/quant.h's
rows, kernels/quant_tiles.h's tiles of 16 rows), the same random blocks, in one process: the byte products of
1-16 input rows (a decode, verify or batched step) and a prompt chunk's product through dequantized weights
(bfloat16 inputs), each pair timed alternately, medians of the per-round ratios. Shapes: a 1B Llama's (hidden
2048, MLP 8192, its output layer of 49152 rows; its ffn_gate also as Q5_K, as a Q5_K_M file holds it, and as
Q3_K, Q2_K and IQ4_XS) and
Gemma 3 270M's K-format matrices (Q4_K attn_output 640 x 1024, Q6_K ffn_down 640 x 2048); then the 32-element
formats: the 1B ffn_gate as Q4_0 and Q8_0, the default model's Q4_1 ffn_gate (1536 x 576) and Q8_0 output
layer (49152 x 576), and that ffn_gate as IQ4_NL.

    python benchmarks/tiled_k_rows.py [--inputs 1 2 4 8 16] [--threads 1 2] [--seconds 3] [--types Q3_K ...]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [("1B output", "Q6_K", 49152, 2048), ("1B ffn_gate", "Q4_K", 8192, 2048), ("1B ffn_gate", "Q5_K", 8192, 2048), ("1B ffn_down", "Q6_K", 2048, 8192),
          ("1B attn_q", "Q4_K", 2048, 2048),
          ("Gemma attn_output", "Q4_K", 640, 1024), ("Gemma ffn_down", "Q6_K", 640, 2048),
          ("1B ffn_gate", "Q3_K", 8192, 2048), ("1B ffn_gate", "Q2_K", 8192, 2048), ("1B ffn_gate", "IQ4_XS", 8192, 2048),
          ("1B ffn_gate", "Q4_0", 8192, 2048), ("1B ffn_gate", "Q8_0", 8192, 2048),
          ("SmolLM2 ffn_gate", "Q4_1", 1536, 576), ("SmolLM2 output", "Q8_0", 49152, 576),
          ("SmolLM2 ffn_gate", "IQ4_NL", 1536, 576)]


def main() -> None:
    import numpy as np
    import torch

    from pair_products import random_blocks  # (this folder's: valid blocks of any format)

    from tokenmill.kernels import quant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompt", type=int, default=256, help="rows of the prompt chunk (dequantized path)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seconds", type=float, default=3.0, help="per product: seconds of alternated rounds")
    ap.add_argument("--types", nargs="+", help="only these formats (default: every shape above)")
    args = ap.parse_args()
    m = quant.load()
    if m is None or not m.vnni:
        sys.exit("needs the kernels built with AVX-512 VNNI (the tiles' CPUs)")
    rng = np.random.default_rng(0)
    print(f"{'matrix':18s} {'type':5s} {'rows':>5s} {'threads':>7s}   row layout -> tiles (median ratio)")
    for name, qtype, n, k in SHAPES:
        if args.types and qtype not in args.types:
            continue
        code, data = random_blocks(qtype, n, k, rng)
        blocks = torch.from_numpy(data)
        layouts = {"rows": (m.repack(blocks, code, k), code), "tiles": (m.repack(blocks, code | quant.TILED, k), code | quant.TILED)}
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.inputs + [args.prompt]:
                prompt = rows == args.prompt
                x = torch.randn(rows, k).bfloat16()

                def run(layout: str) -> float:
                    w, t = layouts[layout]
                    reps = 2 if prompt else max(2, int(2e6 / (n * k)))
                    start = time.perf_counter()
                    for _ in range(reps):
                        m.qmatmul(x, w, t, k, float_inputs=prompt)
                    return (time.perf_counter() - start) / reps

                for _ in range(3):
                    run("rows"), run("tiles")
                times = {"rows": [], "tiles": []}
                end = time.time() + args.seconds
                while time.time() < end:
                    for layout in random.sample(["rows", "tiles"], 2):
                        times[layout].append(run(layout))
                ratio = statistics.median(a / b for a, b in zip(times["rows"], times["tiles"]))
                label = f"{rows} (prompt)" if prompt else str(rows)
                print(f"{name:18s} {qtype:5s} {label:>5s} {threads:>7d}   {statistics.median(times['rows']) * 1e6:9.1f} -> "
                      f"{statistics.median(times['tiles']) * 1e6:9.1f} us ({ratio:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
