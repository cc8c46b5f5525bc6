"""One product with block-format weights, bfloat16 inputs of M rows: the dequantized-tile path's time over
the int8 byte products' (set_float_rows 1 against a huge value, alternated 7 times, medians), on the default
model's and Gemma 3 270M's shapes with random blocks: docs/benchmarks.md, "4- and 5-bit products and the
bfloat16 switch".

    python benchmarks/float_rows_products.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gguf  # noqa: E402

from tests.test_quant_kernels import random_blocks  # noqa: E402
from tokenmill.kernels import quant  # noqa: E402

T = gguf.GGMLQuantizationType
SHAPES = [(T.Q4_1, 1536, 576), (T.Q4_1, 576, 1536), (T.Q8_0, 576, 576), (T.Q4_K, 640, 1024),
          (T.Q5_0, 2048, 640), (T.Q6_K, 640, 2048)]


def main() -> None:
    if quant.load() is None:
        sys.exit("the quantized-weight kernels do not build here")
    rng = np.random.default_rng(0)
    weights = [(q, quant.QuantizedWeight.from_blocks(int(q), (n, k), torch.from_numpy(random_blocks(q, n, k, rng))))
               for q, n, k in SHAPES]
    for rows in (4, 8, 12, 16, 24, 32, 40, 48):
        line = []
        for q, w in weights:
            x = torch.randn(rows, w.shape[1]).bfloat16()
            times: dict = {}
            for _ in range(7):
                for switch in (1, 10**9):
                    quant.set_float_rows(switch)
                    start = time.perf_counter()
                    for _ in range(20):
                        w.matmul(x)
                    times.setdefault(switch, []).append((time.perf_counter() - start) / 20)
            ratio = statistics.median(times[1]) / statistics.median(times[10**9])
            line.append(f"{q.name} {w.shape[0]}x{w.shape[1]} {ratio:.2f}")
        print(f"{rows:3d} rows, dequantized / byte products: " + "  ".join(line), flush=True)
    quant.set_float_rows(0)


if __name__ == "__main__":
    main()
