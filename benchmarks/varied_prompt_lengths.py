"""Prompts of many different lengths, one at a time (max_tokens 1): the median time per prompt and the
process's growth, for a model's bfloat16 prompt products (torch's GEMM, in bucketed row counts:
kernels/quant_product.h, kGemmChunk). docs/benchmarks.md, "Prompt lengths and torch's GEMM".

    python benchmarks/varied_prompt_lengths.py [MODEL] [--prompts 300] [--quantization none] [--warm-gemm-shapes]

--warm-gemm-shapes first runs every linear layer's distinct weight at each bucketed row count (16 to 512 in
steps of 16, the prompt rows' float path), to see whether warming the GEMM kernels at start would keep the
process from growing later.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenmill import LLM, SamplingParams  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def warm_gemm_shapes(llm) -> None:
    import torch

    from tokenmill.kernels import quant
    from tokenmill.kernels.cpu import GEMM_CHUNK, GEMM_ROW_STEP
    from tokenmill.model.layers import _QuantizableLinear

    layers = {}
    for m in llm.engine.model.modules():
        if isinstance(m, _QuantizableLinear):
            key = (tuple((p.qtype, tuple(p.shape)) for p in m.qparts) if m.qweight is not None
                   else tuple(m.weight.shape))
            layers.setdefault(key, m)
    with torch.inference_mode():
        for m in layers.values():
            for rows in range(GEMM_ROW_STEP, GEMM_CHUNK + 1, GEMM_ROW_STEP):
                with quant.prompt_rows(rows, 0):
                    _QuantizableLinear.forward(m, torch.zeros(rows, m.in_features, dtype=llm.engine.dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--warm-gemm-shapes", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    lengths = rng.sample(range(16, 1200), args.prompts)  # every length new
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randrange(100, vocab) for _ in range(64)]], params, use_tqdm=False)  # warm-up
    if args.warm_gemm_shapes:
        before, t = rss_mib(), time.perf_counter()
        warm_gemm_shapes(llm)
        print(f"GEMM shapes warmed in {time.perf_counter() - t:.2f} s: RSS {before:.0f} -> {rss_mib():.0f} MiB")
    start_rss, times, marks = rss_mib(), [], []
    for i, n in enumerate(lengths):
        if i and i % (args.prompts // 4) == 0:
            marks.append(f"{rss_mib():.0f}")
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        t = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        times.append((time.perf_counter() - t) / n * 1000)
    print(f"{args.prompts} prompts of 16-1199 tokens, each length new: median {statistics.median(times):.3f} ms a "
          f"prompt token, RSS {start_rss:.0f} -> {' -> '.join(marks)} -> {rss_mib():.0f} MiB (each quarter)")


if __name__ == "__main__":
    main()
