"""Paired A/B of two versions of the CPU kernels: the fused decode forward of the default model, at
given context lengths, alternating the two builds round after round.

    python benchmarks/kernel_ab.py --base HEAD~1 [--contexts 200,1500] [--seconds 120]

Builds the working tree's tokenmill/kernels/cpu_kernels.cpp and the one at git revision BASE, captures
a real batch-1 decode step at each context, then, each round, probes the memory bandwidth and runs
every (build, context) pair in random order (the median of 3 forward passes each). Rounds are grouped
by the memory state their probe found, since this machine's memory switches between two speeds.
Differences under a few percent are within what two copies of one build show here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import tokenmill.kernels.cpu as cpu_kernels  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

FAST_GBPS = 45.0  # probe readings above this: the memory's fast state


def capture_step(llm: LLM, context: int):
    """The model inputs of a real decode step at the given context length."""
    engine, model = llm.engine, llm.engine.model
    captured = {}
    real = model.forward

    def spy(ids, pos, kv, meta):
        captured.update(ids=ids, pos=pos, meta=meta)
        return real(ids, pos, kv, meta)

    model.forward = spy
    try:
        engine.add_request(None, [(1000 + 7 * j) % engine.vocab_size for j in range(context - 2)],
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        model.forward = real
    return captured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the kernels to compare against")
    ap.add_argument("--contexts", default="200,1500")
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    source = subprocess.run(["git", "show", f"{args.base}:tokenmill/kernels/cpu_kernels.cpp"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    base_file = os.path.join(tempfile.mkdtemp(), "cpu_kernels.cpp")
    with open(base_file, "w") as f:
        f.write(source)
    builds = {"base": cpu_kernels.build(base_file), "new": cpu_kernels.build(cpu_kernels._SOURCE)}

    llm = LLM(dtype="bfloat16", num_scheduler_steps=1)
    model, kv = llm.engine.model, llm.engine.runner.kv_caches
    steps = {c: capture_step(llm, c) for c in map(int, args.contexts.split(","))}
    decoders = {}
    for name, module in builds.items():
        cpu_kernels._module = module
        decoders[name] = model._build_fused_decoder(kv, llm.engine.config.block_size)
    probe = torch.ones(1 << 26)  # 256 MiB
    rounds = []
    end = time.time() + args.seconds
    with torch.inference_mode():
        while time.time() < end:
            start = time.perf_counter()
            probe.sum()
            r = {"GBps": probe.numel() * 4 / (time.perf_counter() - start) / 1e9}
            pairs = [(n, c) for n in decoders for c in steps]
            random.shuffle(pairs)
            for name, c in pairs:
                s, times = steps[c], []
                for _ in range(3):
                    t = time.perf_counter()
                    decoders[name].forward(s["ids"], s["pos"], s["meta"].slot_mapping,
                                           s["meta"].decode_block_tables, s["meta"].decode_seq_lens)
                    times.append(time.perf_counter() - t)
                r[name, c] = statistics.median(times)
            rounds.append(r)
    for state, chosen in (("fast", [r for r in rounds if r["GBps"] > FAST_GBPS]),
                          ("usual", [r for r in rounds if r["GBps"] <= FAST_GBPS])):
        if not chosen:
            print(f"{state} memory state: no rounds")
            continue
        for c in steps:
            base = statistics.median(r["base", c] for r in chosen) * 1e3
            new = statistics.median(r["new", c] for r in chosen) * 1e3
            ratio = statistics.median(r["new", c] / r["base", c] for r in chosen)
            print(f"{state} memory state, {len(chosen)} rounds, context {c}: base {base:.2f} ms, new {new:.2f} ms, "
                  f"new/base {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
