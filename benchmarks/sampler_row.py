"""The sampler's call alone on one row of random logits, its CPU kernel against torch's operations.

    python benchmarks/sampler_row.py [--vocab 49152] [--calls 300]

Rows of a 49,152-token vocabulary (the default model's), normal logits of standard deviation 0.5, 1 and 3
(0.5: the nucleus holds most of the vocabulary; 3: a few hundred tokens), in bfloat16 as the model gives
them. Prints the median time of a call for each sampling setting and path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.engine.request import Request  # noqa: E402
from tokenmill.kernels import cpu as cpu_kernels  # noqa: E402
from tokenmill.sample.sampler import Sampler  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

SETTINGS = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
            dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        sys.exit("the CPU kernels do not build on this machine")
    g = torch.Generator().manual_seed(0)
    for sd in (0.5, 1.0, 3.0):
        row = (torch.randn(1, args.vocab, generator=g) * sd).to(torch.bfloat16)
        for kwargs in SETTINGS:
            times = {}
            for path in ("torch", "kernel"):
                cpu_kernels.SAMPLE_KERNEL = path == "kernel"
                sampler = Sampler(args.vocab, 0)
                req = Request("r", [0], SamplingParams(seed=1, **kwargs), 16)
                ts = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    sampler(row, [req])
                    ts.append(time.perf_counter() - t)
                times[path] = statistics.median(ts[args.calls // 5:]) * 1e3
            setting = ", ".join(f"{k} {v}" for k, v in kwargs.items())
            print(f"sd {sd}, {setting}: torch {times['torch']:.3f} ms, kernel {times['kernel']:.3f} ms "
                  f"({times['torch'] / times['kernel']:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
