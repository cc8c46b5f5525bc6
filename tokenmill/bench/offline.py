"""`bench throughput` and `bench latency`: the engine measured in-process."""

from __future__ import annotations

import json
import time

from tokenmill.bench.datasets import BenchRequest, chat_requests, jsonl_requests, percentiles, random_requests
from tokenmill.sampling_params import SamplingParams


def build_requests(args, llm) -> list[BenchRequest]:
    from tokenmill.bench.datasets import parse_range

    out_range = parse_range(args.output_len)
    if args.dataset == "random":
        return random_requests(args.num_prompts, parse_range(args.input_len), out_range, llm.engine.vocab_size,
                               args.seed)
    if args.dataset == "chat":
        return chat_requests(args.num_prompts, llm.get_tokenizer(), out_range, args.seed)
    return jsonl_requests(args.dataset, llm.get_tokenizer(), out_range, args.num_prompts, args.seed)


def _speculation(llm, before: tuple[int, int, int] | None = None):
    """(drafts, draft tokens, accepted tokens) so far; with `before`, the figures of the run since then
    (None where speculation is off)."""
    stats = llm.engine.spec_stats
    now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    if before is None:
        return now
    if llm.engine.proposer is None:
        return None
    drafts, proposed, accepted = (a - b for a, b in zip(now, before))
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}


def _print_speculation(r: dict) -> None:
    s = r.get("speculation")
    if s:
        print(f"speculation: acceptance {100 * s['acceptance_rate']:.1f}% of {s['draft_tokens']} proposed tokens, "
              f"mean accepted length {s['mean_accepted_length']:.2f} tokens per verification")


def run_throughput(llm, requests: list[BenchRequest], ignore_eos: bool = True) -> dict:
    """Submit every request at once and run to completion; tokens/s over the wall time."""
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=ignore_eos) for r in requests]
    spec = _speculation(llm)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_in = sum(len(r.prompt_ids) for r in requests)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(requests), "elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
            "input_tokens": n_in, "output_tokens": n_out, "input_tokens_per_s": n_in / elapsed,
            "output_tokens_per_s": n_out / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
            "speculation": _speculation(llm, spec)}


def run_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int, warmup: int, seed: int = 0,
                temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """One batch of identical shape, repeated: end-to-end latency, TTFT and TPOT per request. Tokens are
    greedy at temperature 0, else sampled at that temperature (from the top_p nucleus)."""
    e2e, ttft, tpot = [], [], []
    spec = None
    for i in range(warmup + iters):
        if i == warmup:
            spec = _speculation(llm)
        reqs = random_requests(batch_size, (input_len, input_len), (output_len, output_len), llm.engine.vocab_size,
                               seed + i)
        llm.engine.reset_prefix_cache()  # each iteration computes its prompts afresh
        start = time.time()
        outs = llm.generate([r.prompt_ids for r in reqs],
                            SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len,
                                           ignore_eos=True),
                            use_tqdm=False)
        end = time.time()
        if i < warmup:
            continue
        for o in outs:
            m = o.metrics
            e2e.append(end - start)
            ttft.append(m.first_token_time - start)
            if output_len > 1:
                tpot.append((m.finished_time - m.first_token_time) / (output_len - 1))
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iters": iters,
            "temperature": temperature, "top_p": top_p, "e2e_s": percentiles(e2e), "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot), "speculation": _speculation(llm, spec)}


def print_throughput(r: dict) -> None:
    print(f"requests: {r['requests']}  wall time: {r['elapsed_s']:.2f} s")
    print(f"requests/s: {r['requests_per_s']:.2f}")
    print(f"input tokens/s: {r['input_tokens_per_s']:.1f}  output tokens/s: {r['output_tokens_per_s']:.1f}  "
          f"total tokens/s: {r['total_tokens_per_s']:.1f}")
    _print_speculation(r)


def print_latency(r: dict) -> None:
    how = "greedy" if not r["temperature"] else f"sampled at temperature {r['temperature']:g}, top_p {r['top_p']:g}"
    print(f"batch {r['batch_size']}, input {r['input_len']}, output {r['output_len']} ({how}), {r['iters']} iterations")
    for key, label in (("e2e_s", "end-to-end"), ("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        s = r[key]
        print(f"{label:>11}: mean {s['mean'] * 1e3:9.2f} ms  p50 {s['p50'] * 1e3:9.2f}  p90 {s['p90'] * 1e3:9.2f}  "
              f"p99 {s['p99'] * 1e3:9.2f}")
    _print_speculation(r)


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
