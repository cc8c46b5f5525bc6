"""Batch-1 decode and 512-token prefill of GGUF files, tokenmill against llama.cpp's llama-bench on the same
files, alternated.

Each round runs, for every file: tokenmill in a fresh process (load, one warm-up generation, then
--tokens greedy tokens from a short prompt, timed less the prompt's own step (the first token, timed
apart), as llama-bench's tg times decode alone; then one 512-token prompt, timed after a warm-up) and
`llama-bench -p 512 -n TOKENS` on the same file and thread count. Rounds alternate the engines, because
this machine's memory bandwidth changes for minutes at a time; the figures are medians over the rounds. Also reported: tokenmill's resident memory after
load next to the file's size.

    python benchmarks/quantized_decode.py FILE.gguf [FILE.gguf ...] [--rounds 3] [--tokens 32]
        [--quantization auto|none] [--dtype auto|float32|bfloat16] [--llama-cpp-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
path, tokens, quantization, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
llm = LLM(path, dtype=dtype, kv_cache_memory="128MiB", quantization=quantization, enable_prefix_caching=False,
          max_num_batched_tokens=512)
import gc
gc.collect()
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
first = SamplingParams(max_tokens=1, temperature=0)
llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
def timed(params):
    t = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    return time.perf_counter() - t
# decode alone, as llama-bench's tg: the whole generation less its first token (the prompt's step, a median of 3)
first_s = sorted(timed(first) for _ in range(3))[1]
decode = (tokens - 1) / (timed(sp) - first_s)
prompt = [(i * 7919) % 40000 + 100 for i in range(512)]  # one 512-token prompt, one step (no chunking)
one = SamplingParams(max_tokens=1, temperature=0)
llm.generate([prompt], one, use_tqdm=False)
t = time.perf_counter()
llm.generate([prompt], one, use_tqdm=False)
print(json.dumps({"tok_s": decode, "pp_s": 512 / (time.perf_counter() - t), "rss": rss, "first_s": first_s}))
"""


def tokenmill_decode(path: str, tokens: int, quantization: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(tokens), quantization, dtype], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(exe: str, path: str, tokens: int, threads: int) -> tuple[float, float]:
    """(decode tok/s over `tokens` tokens, prefill tok/s of a 512-token prompt)."""
    out = subprocess.run([exe, "-m", path, "-p", "512", "-n", str(tokens), "-t", str(threads), "-r", "2",
                          "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return (next(float(r["avg_ts"]) for r in rows if r["n_gen"] > 0),
            next(float(r["avg_ts"]) for r in rows if r["n_prompt"] > 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto", help="tokenmill's activation dtype (auto: bfloat16 where the CPU "
                   "has AVX-512 BF16 or AMX, else float32)")
    p.add_argument("--llama-cpp-dir", default=os.path.expanduser("~/.cache/tokenmill/llama.cpp"))
    args = p.parse_args()
    exe = os.path.join(args.llama_cpp_dir, "bin", "llama-bench")
    threads = len(os.sched_getaffinity(0))
    ours = {f: [] for f in args.files}
    theirs = {f: [] for f in args.files}
    ours_pp = {f: [] for f in args.files}
    theirs_pp = {f: [] for f in args.files}
    rss, first = {}, {f: [] for f in args.files}
    for r in range(args.rounds):
        for f in args.files:
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for engine in order:
                if engine == 0:
                    res = tokenmill_decode(f, args.tokens, args.quantization, args.dtype)
                    ours[f].append(res["tok_s"])
                    ours_pp[f].append(res["pp_s"])
                    rss[f] = res["rss"]
                    first[f].append(res["first_s"])
                else:
                    tg, pp = llama_bench(exe, f, args.tokens, threads)
                    theirs[f].append(tg)
                    theirs_pp[f].append(pp)
            print(f"round {r + 1}: {os.path.basename(f)} tokenmill {ours[f][-1]:.2f} llama.cpp {theirs[f][-1]:.2f} tok/s "
                  f"(tokenmill's first token of the short prompt: {first[f][-1] * 1e3:.0f} ms)", flush=True)
    print(f"\n| file | size | tokenmill RSS after load | tokenmill tok/s | llama-bench tg{args.tokens} tok/s | ratio "
          "| tokenmill prefill 512 tok/s | llama-bench pp512 tok/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in args.files:
        a, b = statistics.median(ours[f]), statistics.median(theirs[f])
        c, d = statistics.median(ours_pp[f]), statistics.median(theirs_pp[f])
        print(f"| {os.path.basename(f)} | {os.path.getsize(f) / 2**20:.0f} MiB | {rss[f] / 2**20:.0f} MiB | {a:.2f} | "
              f"{b:.2f} | {a / b:.2f}x | {c:.1f} | {d:.1f} | {c / d:.2f}x |")


if __name__ == "__main__":
    main()
