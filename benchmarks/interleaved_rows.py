"""The engine's two layouts of Q8_0 and Q4_1 weights, on one thread and without the engine around them:
rows interleaved by 16 (kernels/quant_tiles.h: a vector's lanes are 16 weight rows; the engine's layout for
such matrices where the CPU has AVX-512 VNNI) against the row layout (kernels/quant.h: lanes are 16 blocks
of one row), products of 1-8 input rows. Builds interleaved_rows.cpp with g++ -O3 -march=native (AVX-512
VNNI needed) and runs it on the default model's shapes: its layers' Q4_1 matrices, its Q8_0 output layer
(1024 rows, in cache, and all 49152, from memory) and Gemma 3 270M's 640-wide Q8_0 output layer rows; then
every product of one decode step of the default model's shapes in turn (30 layers and the output layer,
96 MB of random blocks, from memory), as a step with 1-8 query rows would take them.

    python benchmarks/interleaved_rows.py [--inputs 1 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "tokenmill", "kernels")

SHAPES = [  # (format, K, N)
    ("q4_1", 576, 1536),   # the default model's ffn_gate / ffn_up
    ("q4_1", 1536, 576),   # its ffn_down
    ("q4_1", 576, 576),    # its attn_q / attn_output
    ("q8_0", 576, 1024),   # 1024 rows of its output layer (in cache)
    ("q8_0", 576, 49152),  # the whole output layer (30 MB, from memory)
    ("q8_0", 640, 4096),   # 4096 rows of Gemma 3 270M's output layer
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", nargs="+", default=["1", "2", "4", "8"])
    args = ap.parse_args()
    if "avx512_vnni" not in open("/proc/cpuinfo").read():
        sys.exit("the tile kernels need AVX-512 VNNI")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "interleaved_rows")
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", f"-I{KERNELS}",
                        os.path.join(HERE, "interleaved_rows.cpp"), "-o", exe], check=True)
        for fmt, k, n in SHAPES:
            subprocess.run([exe, fmt, str(k), str(n), *args.inputs], check=True)
        subprocess.run([exe, "step", *args.inputs], check=True)


if __name__ == "__main__":
    main()
