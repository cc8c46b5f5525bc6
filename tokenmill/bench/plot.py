"""Throughput against latency over a concurrency sweep, tokenmill and transformers, as a PNG."""

from __future__ import annotations

import time

from tokenmill.bench.datasets import random_requests


def concurrency_sweep_plot(llm, hf_runner, args, path: str, levels=(1, 4, 16, 64)) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    from tokenmill.bench.compare import TokenmillRunner

    vocab = llm.engine.vocab_size
    ours = TokenmillRunner(llm)
    points = {"tokenmill": [], "transformers": []}
    for c in levels:
        reqs = random_requests(max(c, 2 * c), args.input_range, args.output_range, vocab, seed=500 + c)
        llm.engine.scheduler.max_num_seqs = c  # at most c requests in flight
        start = time.perf_counter()
        n = ours.generate(reqs)
        t = time.perf_counter() - start
        points["tokenmill"].append((t / (len(reqs) / c), n / t))
        hf_runner.batch_size = c
        start = time.perf_counter()
        n = hf_runner.generate(reqs)
        t = time.perf_counter() - start
        points["transformers"].append((t / (len(reqs) / c), n / t))
    llm.engine.scheduler.max_num_seqs = llm.config.max_num_seqs
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in points.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for (x, y), c in zip(pts, levels):
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean request latency (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs latency (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
