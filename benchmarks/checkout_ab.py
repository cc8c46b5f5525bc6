"""Paired A/B of two checkouts of the whole engine (kernels, weight layout, scheduler and all): greedy decode
tok/s at several batch sizes, each checkout in fresh processes, alternated round after round.

    python benchmarks/checkout_ab.py --base HEAD~1 [--model FILE.gguf] [--batch 1 4 8] [--tokens 128] [--rounds 4]
        [--busy] [--temperature T]
    python benchmarks/checkout_ab.py --base HEAD~1 --prompt-words 4 16 256 1024 [--model FILE.gguf] [--rounds 4]
    python benchmarks/checkout_ab.py --base HEAD~1 --serve [--temperature T] [--tokens 300] [--model FILE.gguf] [--busy]

Checks BASE out into a temporary git worktree (its kernels built in an extensions folder of its own) and
runs the same child against it and against the working tree: load the model (the default one unless
--model names another), one warm-up generation, then for each batch size B one generate call of B short
prompts of --tokens tokens each (ignore_eos), timed whole: output tokens over the wall time, so the short
prompts' single steps are included. kernel_ab.py compares two builds of the fused decoder over one weight
layout; this compares anything, at the price of a fresh load per round. With --busy, a process spins on
the last CPU through the timed calls (after the warm-up), as in the soak's busy phases: the rates with one CPU
taken by another process. With --temperature, the requests sample (each with a seed of its own) instead
of decoding greedily. With --prompt-words, time to first token instead: prompts of that many words
(max_tokens 1, prefix cache off), the median of 5 a length, in milliseconds (lower is better). With
--serve, decode through the server: `tokenmill serve` started from each checkout, one chat request at a
time (a ~600-token prompt, --tokens output tokens, ignore_eos), three streamed and three read whole; the
median decode rate of each (streamed: from the first token's chunk to the last's; read whole: the
request's time less a one-token request's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.bench.soak import _Spinner
from tokenmill.model.hub import pull
path, batches, tokens = sys.argv[1] or pull(), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
busy = sys.argv[4] == "1"
llm = LLM(path, max_num_seqs=max(batches), enable_prefix_caching=False, kv_cache_memory="512MiB")
prompts = [f"Write a short story number {i} about a cat who" for i in range(max(batches))]
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
spin = _Spinner()  # the soak's busy phase: a process pinned to the last CPU
if busy:
    spin.start()
    time.sleep(0.5)
temperature = float(sys.argv[5])
rates = {}
try:
    for b in batches:
        sps = [SamplingParams(temperature=temperature, seed=i if temperature else None, max_tokens=tokens,
                              ignore_eos=True) for i in range(b)]
        start = time.perf_counter()
        outs = llm.generate(prompts[:b], sps)
        rates[b] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
finally:
    spin.stop()
print("RESULT " + json.dumps(rates))
"""

_TTFT_CHILD = r"""
import json, statistics, sys, time
from tokenmill import LLM, SamplingParams
from tokenmill.model.hub import pull
llm = LLM(sys.argv[1] or pull(), enable_prefix_caching=False, kv_cache_memory="512MiB")
words = "the quick brown fox jumps over a lazy dog while seven cats watch from the old stone wall".split()
sp = SamplingParams(temperature=0, max_tokens=1)
llm.generate(["warm up " * 40], sp)
out = {}
for n in [int(w) for w in sys.argv[2].split(",")]:
    prompt = " ".join(words[i % len(words)] for i in range(n))
    llm.generate([prompt], sp)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate([prompt], sp)
        times.append(time.perf_counter() - start)
    out[n] = statistics.median(times) * 1e3
print("RESULT " + json.dumps(out))
"""

_SERVE_CHILD = r"""
import json, statistics, subprocess, sys, time
import httpx
sys.path.insert(0, sys.argv[4])
import spec_decode as sd
from tokenmill.model.hub import pull
from tokenmill.bench.soak import _Spinner
model_path, tokens, temperature = sys.argv[1] or pull(), int(sys.argv[2]), float(sys.argv[3])
busy = sys.argv[5] == "1"
port = sd.free_port()
url = f"http://127.0.0.1:{port}"
spin = _Spinner()  # --busy: a process pinned to the last CPU through the timed requests
proc = sd.start([sys.executable, "-m", "tokenmill.cli", "serve", model_path, "--port", str(port), "--log-level",
                 "warning", "--max-num-seqs", "1"], url)
try:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    messages = sd.grounded_messages()[0]

    def request(max_tokens, stream):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "seed": 1, "ignore_eos": True, "stream": stream}
        start, chunks = time.perf_counter(), []
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                        chunks.append(time.perf_counter())
        else:
            httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
        return time.perf_counter() - start, chunks

    request(16, False)
    if busy:
        spin.start()
        time.sleep(0.5)
    streamed, whole = [], []
    for _ in range(3):
        _, chunks = request(tokens, True)
        streamed.append((len(chunks) - 1) / (chunks[-1] - chunks[0]))
        first, _ = request(1, False)
        total, _ = request(tokens, False)
        whole.append((tokens - 1) / (total - first))
    print("RESULT " + json.dumps({"streamed": statistics.median(streamed), "read whole": statistics.median(whole)}))
finally:
    spin.stop()
    proc.terminate()
    proc.wait(30)
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True, help="git revision to compare the working tree with")
    p.add_argument("--model", default="", help="a GGUF file (default: the default model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--busy", action="store_true", help="a process spinning on one CPU through the timed calls")
    p.add_argument("--prompt-words", type=int, nargs="+", default=None,
                   help="time to first token of prompts of these word counts instead of decode rates")
    p.add_argument("--temperature", type=float, default=0.0, help="sampled requests (each seeded) instead of greedy")
    p.add_argument("--serve", action="store_true", help="decode through the server, streamed and read whole")
    args = p.parse_args()
    ttft = args.prompt_words is not None
    cases = args.prompt_words if ttft else ["streamed", "read whole"] if args.serve else args.batch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scratch = tempfile.mkdtemp(prefix="tokenmill-ab-")
    base = os.path.join(scratch, "base")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", base, args.base], check=True,
                   capture_output=True)
    trees = {"base": base, "working tree": root}
    rates: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                env = dict(os.environ, PYTHONPATH=trees[name],
                           TORCH_EXTENSIONS_DIR=os.path.join(scratch, "ext-" + name.replace(" ", "-")))
                if ttft:
                    child = [_TTFT_CHILD, args.model, ",".join(map(str, cases))]
                elif args.serve:
                    child = [_SERVE_CHILD, args.model, str(args.tokens), str(args.temperature),
                             os.path.join(root, "benchmarks"), "1" if args.busy else "0"]
                else:
                    child = [_CHILD, args.model, ",".join(map(str, cases)), str(args.tokens), "1" if args.busy else "0",
                             str(args.temperature)]
                out = subprocess.run([sys.executable, "-c", *child], cwd=trees[name], env=env, capture_output=True,
                                     text=True)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
                rates[name].append(json.loads(line[len("RESULT "):]))
                label = "{} words {:.1f} ms" if ttft else "{} {:.1f}" if args.serve else "batch {} {:.1f}"
                print(f"round {r + 1}, {name}: " + ", ".join(label.format(b, v) for b, v in rates[name][-1].items()),
                      flush=True)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", base], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(("time to first token, ms" if ttft else "output tok/s") + ", medians over rounds (paired ratios, working tree over base):")
    for b in map(str, cases):
        old = [x[b] for x in rates["base"]]
        new = [x[b] for x in rates["working tree"]]
        ratios = " ".join(f"{n / o:.3f}" for o, n in zip(old, new))
        print(f"  {'words ' if ttft else '' if args.serve else 'batch '}{b}: base {statistics.median(old):.1f}, working tree {statistics.median(new):.1f} ({ratios})")


if __name__ == "__main__":
    main()
