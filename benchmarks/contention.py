"""Batch-1 decode with one CPU taken by another process: tokenmill and llama.cpp's llama-bench, each
quiet and then beside a process spinning on one CPU, alternated over rounds.

The figure that matters is each engine's ratio contended / quiet (proportional to the CPUs left would be
0.5 on 2 CPUs). --checkout runs another tokenmill checkout as well (an earlier version, say), by
putting it first on PYTHONPATH. --fixed-team turns off both of tokenmill's ways of going on with one thread
(the team's lag switch and the step governor), so that every step runs on the two threads beside the busy
CPU, as llama.cpp's fixed team does: the contended rate then shows what each synchronisation of a step
costs when a thread keeps losing its core.

    python benchmarks/contention.py MODEL.gguf [--rounds 3] [--tokens 64] [--checkout DIR ...]
        [--llama-cpp-dir DIR] [--fixed-team]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, os, subprocess, sys, time
from tokenmill import LLM, SamplingParams
path, tokens, spin_cpu, fixed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
def rate():
    t = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
    return tokens / (time.perf_counter() - t)
rate()
if fixed:  # every step on the whole team: no lag switch, no step governor
    llm.engine.model._fused[1].run_solo(0, adaptive=False)
    llm.engine.runner.governor.WAITED = float("inf")
quiet = rate()
spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{spin_cpu}}})\nwhile True: pass"])
try:
    time.sleep(0.5)
    busy = rate()
finally:
    spin.kill()
    spin.wait()
fused = getattr(llm.engine.model, "_fused", None)
stats = list(fused[1].team_stats()) if fused and hasattr(fused[1], "team_stats") else None
governor = getattr(llm.engine.runner, "governor", None)
print(json.dumps({"quiet": quiet, "busy": busy, "team_stats": stats,
                  "governor": governor.stats() if governor is not None else None}))
"""


def tokenmill(path: str, tokens: int, spin_cpu: int, checkout: str | None, fixed: bool = False) -> dict:
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = os.path.abspath(checkout) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(tokens), str(spin_cpu), str(int(fixed))],
                         capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.abspath(checkout) if checkout else None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(exe: str, path: str, tokens: int, threads: int) -> float:
    out = subprocess.run([exe, "-m", path, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "2", "-o", "json"],
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def llama_pair(exe: str, path: str, tokens: int, threads: int, spin_cpu: int) -> dict:
    quiet = llama_bench(exe, path, tokens, threads)
    spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{spin_cpu}}})\nwhile True: pass"])
    try:
        busy = llama_bench(exe, path, tokens, threads)
    finally:
        spin.kill()
        spin.wait()
    return {"quiet": quiet, "busy": busy}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--checkout", action="append", default=[])
    p.add_argument("--llama-cpp-dir", default=os.path.expanduser("~/.cache/tokenmill/llama.cpp"))
    p.add_argument("--fixed-team", action="store_true", help="tokenmill never goes on with one thread")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    spin_cpu = cpus[-1]
    exe = os.path.join(args.llama_cpp_dir, "bin", "llama-bench")
    engines = [("tokenmill", None)] + [(f"tokenmill@{c}", c) for c in args.checkout]
    if os.path.exists(exe):
        engines.append(("llama.cpp", "llama"))
    results = {name: [] for name, _ in engines}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for name, how in order:
            if how == "llama":
                res = llama_pair(exe, args.model, args.tokens, len(cpus), spin_cpu)
            else:
                res = tokenmill(args.model, args.tokens, spin_cpu, how, args.fixed_team)
            results[name].append(res)
            print(f"round {r + 1}: {name} quiet {res['quiet']:.2f} busy {res['busy']:.2f} tok/s "
                  f"({res['busy'] / res['quiet']:.2f}x)" + (f" team {res['team_stats']}" if res.get("team_stats") else "")
                  + (f" governor {res['governor']}" if res.get("governor") else ""),
                  flush=True)
    print("\n| engine | quiet tok/s | one CPU busy tok/s | ratio (median of rounds) |\n| --- | --- | --- | --- |")
    for name, rs in results.items():
        q = statistics.median(x["quiet"] for x in rs)
        b = statistics.median(x["busy"] for x in rs)
        ratio = statistics.median(x["busy"] / x["quiet"] for x in rs)
        print(f"| {name} | {q:.2f} | {b:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
