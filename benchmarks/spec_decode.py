"""Speculative decoding, end to end through each engine's own OpenAI-compatible server.

Workloads (greedy, the same chat prompts for every engine):
  grounded  the model is asked to repeat, lightly edit, or summarise with quotes a passage or code file of
            300-800 tokens (taken from this repository's own files), where prompt lookup finds its proposals.
  chat      `bench throughput`'s chat dataset: open-ended answers.

Configurations, each a fresh server process for every batch size (so that no prompt is in its cache), run
in turn and in reverse order in the next round (memory bandwidth here changes for minutes at a time):
  tokenmill            no speculation
  tokenmill-ngram      --speculative-config '{"method": "ngram", "num_speculative_tokens": K}'
  tokenmill-float      (with --float or --draft) --quantization none: the file's weights dequantized to
                       float32, no speculation
  tokenmill-float-ngram  (with --float) the same with prompt lookup
  tokenmill-draft      (with --draft MODEL) the float target with MODEL as its draft_model: with MODEL the
                       same file, its own quantized blocks propose for its dequantized weights
  tokenmill-self       (with --self) the float target drafting for itself: {"method": "self",
                       "quantization": "int4"}, its own weights quantized at load
  llama.cpp            llama-server (with --llama-server PATH), no speculation
  llama.cpp-ngram      llama-server --spec-type ngram-simple

At each --batch size B, the prompts are sent B at a time (B concurrent requests). Two figures, medians over
rounds: output tokens of all requests over the wall time of all of them (prefill included), and the median
request's decode rate (its tokens after the first over its time after the first: prefill left out).

    python benchmarks/spec_decode.py [MODEL] [--workload grounded] [--batch 1 8] [--rounds 2] \
        [--llama-server ~/.cache/tokenmill/llama.cpp/bin/llama-server] [--draft MODEL] [--self]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)

# (task, file, characters): passages of roughly 300-800 tokens from this repository.
GROUNDED = [
    ("Repeat the following text exactly, word for word.", "README.md", 0, 2200),
    ("Repeat the following Python code exactly.", "tokenmill/spec/proposer.py", 0, 1800),
    ("Rewrite the following Python code, adding a one-line comment above every function.",
     "tokenmill/engine/kv_cache.py", 0, 2000),
    ("Summarise the following text in a few sentences, quoting its key sentences word for word.",
     "docs/benchmarks.md", 0, 2400),
    ("Repeat the following text exactly, word for word.", "docs/benchmarks.md", 2400, 4400),
    ("Repeat the following Python code, renaming the variable `req` to `request` everywhere.",
     "tokenmill/engine/scheduler.py", 3000, 5000),
    ("Fix any typos in the following text and write it out again in full.", "README.md", 2200, 4200),
    ("Repeat the following Python code exactly.", "tokenmill/sample/sampler.py", 2500, 4300),
]


# The warm-up request, unlike any measured prompt.
WARM_UP = [{"role": "user", "content": "Say hello in three words."}]


def grounded_messages() -> list[list[dict]]:
    out = []
    for task, path, a, b in GROUNDED:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()[a:b]
        out.append([{"role": "user", "content": f"{task}\n\n{text}"}])
    return out


def chat_messages(n: int) -> list[list[dict]]:
    """bench throughput's chat dataset, as messages (the same generator, decoded back into turns)."""
    import random

    from tokenmill.bench import datasets

    rng = random.Random(0)
    out = []
    for _ in range(n):
        topic = rng.choice(datasets._CHAT_TOPICS)
        messages = [{"role": "system", "content": "You are a concise and helpful assistant."}]
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "user", "content": rng.choice(datasets._CHAT_ASKS).format(
                t=rng.choice(datasets._CHAT_TOPICS))})
            messages.append({"role": "assistant", "content": "Here is a brief answer. " * rng.randint(3, 20)})
        messages.append({"role": "user", "content": rng.choice(datasets._CHAT_ASKS).format(t=topic)})
        out.append(messages)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(" ".join(cmd))


def commands(args, port: int) -> dict[str, list[str]]:
    tm = [sys.executable, "-m", "tokenmill.cli", "serve", args.model, "--port", str(port), "--log-level", "warning",
          "--max-num-seqs", str(max(args.batch))]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k})
    out = {"tokenmill": tm, "tokenmill-ngram": tm + ["--speculative-config", spec]}
    if args.float:
        out["tokenmill-float"] = tm + ["--quantization", "none"]
        out["tokenmill-float-ngram"] = tm + ["--quantization", "none", "--speculative-config", spec]
    if args.draft:
        draft = json.dumps({"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k})
        out.setdefault("tokenmill-float", tm + ["--quantization", "none"])
        out["tokenmill-draft"] = tm + ["--quantization", "none", "--speculative-config", draft]
    if args.self_draft:
        self_spec = json.dumps({"method": "self", "quantization": "int4", "num_speculative_tokens": args.k})
        out.setdefault("tokenmill-float", tm + ["--quantization", "none"])
        out["tokenmill-self"] = tm + ["--quantization", "none", "--speculative-config", self_spec]
    if args.llama_server:
        ls = [args.llama_server, "-m", args.model, "--port", str(port), "-t", str(os.cpu_count()), "-np",
              str(max(args.batch)), "-c", str(4096 * max(args.batch)), "--temp", "0"]
        out["llama.cpp"] = ls
        out["llama.cpp-ngram"] = ls + ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.k)]
    return out


def run_batch(url: str, model: str, conversations: list[list[dict]], batch: int, max_tokens: int) -> dict:
    """Streams each answer: output tokens over the wall time of all (prefill included), and each request's
    decode rate, its tokens after the first over the time after its first (prefill left out)."""
    def one(messages):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        start, first, tokens = time.perf_counter(), None, 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        decode = (tokens - 1) / (end - first) if first is not None and tokens > 1 and end > first else None
        return tokens, decode, (first or end) - start

    start_t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        done = list(pool.map(one, conversations))
    wall = time.perf_counter() - start_t
    tokens = sum(t for t, _, _ in done)
    rates = [d for _, d, _ in done if d is not None]
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "decode_tok_s": statistics.median(rates) if rates else float("nan"),
            "ttft_s": statistics.median(f for _, _, f in done)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--workload", choices=("grounded", "chat"), default="grounded")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens (llama.cpp: --spec-draft-n-max)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--draft", default=None, help="a draft model for tokenmill-draft")
    p.add_argument("--self", dest="self_draft", action="store_true",
                   help="also tokenmill-self: the float target with its own int4 weights as the draft")
    p.add_argument("--float", action="store_true",
                   help="also tokenmill-float(-ngram): the file's weights dequantized to float32 (decode bound by "
                        "memory bandwidth, where verifying more rows costs little)")
    p.add_argument("--only", nargs="*", default=None, help="configurations to run (default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.model is None:
        from tokenmill.model.hub import pull

        args.model = pull()
    convs = grounded_messages() if args.workload == "grounded" else chat_messages(args.num_prompts)
    convs = convs[:args.num_prompts]
    results: dict[str, dict[int, list[float]]] = {}
    decode: dict[str, dict[int, list[float]]] = {}  # median per-request decode rate (after the first token)
    names = [n for n in commands(args, 0) if args.only is None or n in args.only]
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            # A fresh server for each batch size, warmed up on a prompt of its own: a server that had seen
            # the measured prompts (at an earlier batch size, or as its warm-up) would find them in its
            # prompt cache and skip their prefill.
            for b in args.batch:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start(commands(args, port)[name], url)
                try:
                    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                    run_batch(url, model, [WARM_UP], 1, 16)
                    r = run_batch(url, model, convs, b, args.max_tokens)
                finally:
                    proc.terminate()
                    proc.wait(30)
                results.setdefault(name, {}).setdefault(b, []).append(r["tok_s"])
                decode.setdefault(name, {}).setdefault(b, []).append(r["decode_tok_s"])
                print(f"round {rnd} {name:16s} batch {b}: {r['tok_s']:.1f} output tok/s "
                      f"({r['output_tokens']} tokens in {r['wall_s']:.1f} s); per request: decode "
                      f"{r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s']:.2f} s", flush=True)
    for title, table in (("output tok/s (prefill included)", results),
                         ("per-request decode tok/s (after the first token)", decode)):
        print(f"\nmedian {title}, workload {args.workload}, {len(convs)} prompts, max_tokens {args.max_tokens}")
        base = {b: statistics.median(table["tokenmill"][b]) for b in args.batch} if "tokenmill" in table else None
        for name, per_batch in table.items():
            cells = []
            for b in args.batch:
                m = statistics.median(per_batch[b])
                ratio = f" ({m / base[b]:.2f}x)" if base else ""
                cells.append(f"batch {b}: {m:.1f}{ratio}")
            print(f"{name:16s} " + ", ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"output_tok_s": results, "decode_tok_s": decode}, f, indent=2)


if __name__ == "__main__":
    main()
