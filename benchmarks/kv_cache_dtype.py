"""Decode at long contexts with the KV cache in the model's dtype, int8 or fp8.

For each round and each kv_cache_dtype, in a fresh process: load the model (float32 activations, the
default model's own quantized weights), fill one request's context with a --context-token prompt,
then time --tokens greedy decode tokens from it (batch 1). Each step reads the whole context's K and V
once, so at long contexts the cache's bytes per token set the step time. Also reported: how many
tokens --kv-cache-memory holds. Kinds alternate within each round (memory bandwidth here changes for
minutes at a time); figures are medians over rounds.

    python benchmarks/kv_cache_dtype.py [MODEL] [--contexts 512 4096] [--tokens 32] [--rounds 3]

--attention-only times the decode attention kernel alone (paged_decode_attention, one request, the
default model's heads: 9 query heads, 3 KV heads of 64) over a cache of each format, kinds alternated
call block by call block, and reports microseconds per layer and the cache bytes read per second.

--capacity runs, in a fresh process per kind and round, 32 requests of 400-token prompts and 64 greedy
tokens each through a small cache (--kv-cache-memory, e.g. 64MiB) and reports output tokens per second,
the most requests running at once and the preemptions: what the room of an 8-bit cache buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

KINDS = ("auto", "int8", "fp8")

_CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
model, kind, context, tokens, memory = sys.argv[1] or None, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = LLM(model, dtype="float32", kv_cache_memory=memory, kv_cache_dtype=kind, enable_prefix_caching=False,
          max_num_batched_tokens=1024)
llm.generate([[5, 6, 7, 8] * 16], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)  # warm-up
engine = llm.engine
engine.add_request("r", [(i * 7919) % 40000 + 100 for i in range(context)],
                   SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
start = None  # from the first token on: decode steps only
while engine.has_unfinished_requests():
    for out in engine.step():
        if start is None and out.outputs[0].token_ids:
            start, first = time.perf_counter(), len(out.outputs[0].token_ids)
print(json.dumps({"tok_s": (tokens + 1 - first) / (time.perf_counter() - start),
                  "capacity": engine.num_blocks * engine.config.block_size}))
"""


_CAPACITY = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
model, kind, memory = sys.argv[1] or None, sys.argv[2], sys.argv[3]
llm = LLM(model, dtype="float32", kv_cache_memory=memory, kv_cache_dtype=kind, enable_prefix_caching=False)
prompts = [[(i * 7919 + r * 104729) % 40000 + 100 for i in range(400)] for r in range(32)]
sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
engine = llm.engine
most = 0
step = engine.step
def counting(*a, **k):
    global most
    out = step(*a, **k)
    most = max(most, len(engine.scheduler.running))
    return out
engine.step = counting
before = engine.scheduler.num_preemptions
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
print(json.dumps({"tok_s": 32 * 64 / (time.perf_counter() - t), "running": most,
                  "preemptions": engine.scheduler.num_preemptions - before}))
"""


def capacity(model: str | None, memory: str, rounds: int) -> None:
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            out = subprocess.run([sys.executable, "-c", _CAPACITY, model or "", kind, memory], capture_output=True,
                                 text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            results[kind].append(res)
            print(f"round {r} {kind}: {res}", file=sys.stderr)
    print(f"| kv_cache_dtype ({memory}) | output tok/s, median (runs) | most running | preemptions |")
    print("| --- | --- | --- | --- |")
    for kind in KINDS:
        rows = results[kind]
        runs = ", ".join(f"{x['tok_s']:.1f}" for x in rows)
        print(f"| {kind} | {statistics.median(x['tok_s'] for x in rows):.1f} ({runs}) | {rows[0]['running']} | "
              f"{rows[0]['preemptions']} |")


def run(model: str, kind: str, context: int, tokens: int, memory: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model or "", kind, str(context), str(tokens), memory],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def attention_only(contexts: list[int], rounds: int) -> None:
    import time

    import torch

    from tokenmill.attention import kv_format
    from tokenmill.kernels import cpu as cpu_kernels

    kernel = cpu_kernels.load()
    h, kvh, d, bs = 9, 3, 64, 16
    print("| context | kv_cache_dtype | us per layer | cache GB/s | vs auto |")
    print("| --- | --- | --- | --- | --- |")
    for context in contexts:
        g = torch.Generator().manual_seed(0)
        blocks = -(-context // bs)
        slots = blocks * bs
        k, v = (torch.randn(slots, kvh, d, generator=g) for _ in range(2))
        caches = {"auto": (k, v, None, None)}
        for kind in ("int8", "fp8"):
            kc, vc = (kv_format.KVCache.allocate(kind, slots, kvh, d, lambda shape, dt: torch.zeros(shape, dtype=dt))
                      for _ in range(2))
            kc.write(torch.arange(slots), k)
            vc.write(torch.arange(slots), v)
            caches[kind] = kv_format.kernel_args(kc, vc)
        q = torch.randn(1, h, d, generator=g)
        bt = torch.randperm(blocks, generator=g)[None]
        lens = torch.tensor([context])
        times: dict[str, list[float]] = {kind: [] for kind in caches}
        calls = max(20, 400_000 // context)
        for r in range(rounds * 2):
            for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
                kd, vd, ks, vs = caches[kind]
                kernel.paged_decode_attention(q, kd, vd, bt, lens, bs, d ** -0.5, 0, ks, vs)
                t0 = time.perf_counter()
                for _ in range(calls):
                    kernel.paged_decode_attention(q, kd, vd, bt, lens, bs, d ** -0.5, 0, ks, vs)
                times[kind].append((time.perf_counter() - t0) / calls)
        base = statistics.median(times["auto"])
        for kind in KINDS:
            t = statistics.median(times[kind])
            row = kv_format.bytes_per_row(kind, d, torch.float32)
            print(f"| {context} | {kind} | {t * 1e6:.1f} | {2 * context * kvh * row / t / 1e9:.1f} | {base / t:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--attention-only", action="store_true")
    p.add_argument("--capacity", action="store_true")
    args = p.parse_args()
    if args.capacity:
        capacity(args.model, args.kv_cache_memory, args.rounds)
        return
    if args.attention_only:
        attention_only(args.contexts, args.rounds)
        return
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for context in args.contexts:
            kinds = KINDS if r % 2 == 0 else KINDS[::-1]
            for kind in kinds:
                res = run(args.model, kind, context, args.tokens, args.kv_cache_memory)
                results.setdefault((kind, context), []).append(res)
                print(f"round {r} context {context} {kind}: {res['tok_s']:.1f} tok/s", file=sys.stderr)
    print(f"| context | kv_cache_dtype | tokens in {args.kv_cache_memory} | batch-1 decode tok/s | vs auto |")
    print("| --- | --- | --- | --- | --- |")
    for context in args.contexts:
        base = statistics.median(x["tok_s"] for x in results[("auto", context)])
        for kind in KINDS:
            rows = results[(kind, context)]
            tok_s = statistics.median(x["tok_s"] for x in rows)
            print(f"| {context} | {kind} | {rows[0]['capacity']} | {tok_s:.1f} | {tok_s / base:.2f}x |")


if __name__ == "__main__":
    main()
