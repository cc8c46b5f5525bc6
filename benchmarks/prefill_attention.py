"""A prompt's causal attention alone: the engine's bf16 kernel (prefill_attention) against torch's
scaled_dot_product_attention (its CPU flash attention) on the same random bfloat16 inputs, the default
model's heads (9 query heads, 3 KV heads, head_dim 64) unless told otherwise; medians of 10 calls after 3
warm-up calls, the two alternated in rounds; then each one's error against attention in float64 on the
same inputs (mean and largest absolute difference). On a CPU with AMX the kernel runs twice: on AMX's
tiles (its default there, "amx") and in bf16 pair products ("pairs").

    python benchmarks/prefill_attention.py [--lengths 256 736 2000] [--heads 9 3 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.kernels import cpu as cpu_kernels  # noqa: E402


def median_ms(fn, calls: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64, [n, H, D]."""
    n, h, _ = q.shape
    keys, values = (t.double().repeat_interleave(h // k.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 736, 2000])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "KVH", "D"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("the CPU kernels did not build")
    h, kvh, d = args.heads
    torch.manual_seed(0)
    for length in args.lengths:
        q = torch.randn(length, h, d, dtype=torch.bfloat16)
        k, v = (torch.randn(length, kvh, d, dtype=torch.bfloat16) for _ in range(2))
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        def kernel(amx: bool):
            def run():
                kernels.set_prompt_amx(amx)
                try:
                    return kernels.prefill_attention(q, k, v, d ** -0.5, 0)
                finally:
                    kernels.set_prompt_amx(True)
            return run

        runs = {"amx": kernel(True), "pairs": kernel(False)} if kernels.prompt_amx else {"kernel": kernel(True)}
        runs["sdpa"] = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        first = next(iter(runs))
        for r in range(args.rounds):
            ms = {name: median_ms(fn) for name, fn in runs.items()}
            flops = 2 * 2 * length * length * d * h / 2  # QK^T and PV, causal half
            print(f"length {length}, round {r}: " + ", ".join(
                f"{name} {t:.2f} ms ({flops / t / 1e6:.0f} GFLOP/s)" for name, t in ms.items())
                + "; " + ", ".join(f"{name} / {first} {t / ms[first]:.2f}" for name, t in ms.items() if name != first),
                flush=True)
        ref = reference(q, k, v, d ** -0.5)
        outs = {name: fn().double() for name, fn in runs.items() if name != "sdpa"}
        outs["sdpa"] = runs["sdpa"]()[0].transpose(0, 1).double()
        print(f"length {length}: error against float64, " + ", ".join(
            f"{name} mean {(out - ref).abs().mean():.2e} max {(out - ref).abs().max():.2e}"
            for name, out in outs.items()), flush=True)


if __name__ == "__main__":
    main()
