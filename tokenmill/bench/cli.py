"""`tokenmill bench throughput | latency | serve | soak | roofline | compare`."""

from __future__ import annotations

import asyncio
import json

from tokenmill.bench.offline import write_json


def add_bench_parser(sub, add_engine_args, engine_kwargs) -> None:
    bench = sub.add_parser("bench", help="measure throughput, latency, a server under load, the roofline")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    def dataset_args(p, num_prompts: int, with_seed: bool):
        p.add_argument("--dataset", default="random",
                       help="random | chat (a synthetic chat-like mix) | PATH.jsonl with a 'prompt' per line")
        p.add_argument("--num-prompts", type=int, default=num_prompts)
        p.add_argument("--input-len", default="32-512", help="prompt length range for random, e.g. 32-512")
        p.add_argument("--output-len", default="32-256", help="output length range, e.g. 32-256")
        if with_seed:  # engine commands have --seed already, and it seeds the dataset too
            p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", default=None, help="also write the results to this JSON file")

    p = bsub.add_parser("throughput", help="offline: all requests submitted at once")
    add_engine_args(p)
    dataset_args(p, 256, with_seed=False)
    p.set_defaults(func=lambda a: _throughput(a, engine_kwargs))

    p = bsub.add_parser("latency", help="one batch of fixed shape, repeated after a warm-up")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy tokens; above 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled tokens, in (0, 1]")
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda a: _latency(a, engine_kwargs))

    p = bsub.add_parser("serve", help="load-test any OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--tokenizer", default=None, help="model whose tokenizer builds chat/jsonl prompts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrival rate (req/s) or inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs such as ttft:500 tpot:50 e2el:5000 (ms)")
    p.add_argument("--vocab-size", type=int, default=49152, help="token id range of random prompts")
    dataset_args(p, 200, with_seed=True)
    p.set_defaults(func=_serve)

    p = bsub.add_parser("soak", help="hold a local `tokenmill serve` under a mixed, hostile load; report outcomes, "
                                     "latency, memory")
    p.add_argument("--model", default=None, help="what the server loads (default: the default model)")
    p.add_argument("--server-args", default="", help="more flags for `tokenmill serve`, as one string")
    p.add_argument("--minutes", type=float, default=5.0, help="length of each phase")
    p.add_argument("--phases", default="quiet", help="comma-separated quiet | busy (one CPU taken by a spinning "
                                                     "process), e.g. quiet,busy,quiet,busy")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    p.add_argument("--burst-size", type=int, default=40)
    p.add_argument("--max-queued-requests", type=int, default=32, help="the server's queue limit")
    p.add_argument("--body-timeout", type=float, default=5.0, help="the server's --body-read-timeout")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request unanswered this long is unexpected")
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between RSS and /metrics samples")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the first phase")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_soak)

    p = bsub.add_parser("roofline", help="machine limits and the model's share of them")
    add_engine_args(p)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5, help="decode runs, each between two bandwidth measurements")
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda a: _roofline(a, engine_kwargs))

    p = bsub.add_parser("compare", help="tokenmill against transformers and llama.cpp, each at its best")
    add_engine_args(p)
    p.add_argument("--workloads", default="decode,prefill,throughput")
    p.add_argument("--repeats", type=int, default=3, help="rounds after the warm-up; each figure is their median")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=500)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="32-512")
    p.add_argument("--output-len", default="32-256")
    p.add_argument("--hf-batch-size", type=int, default=None, help="transformers' static batch (default: swept)")
    p.add_argument("--llama-cpp-dir", default=None,
                   help="folder holding llama-bench (or bin/llama-bench); default: where "
                        "benchmarks/build_llama_cpp.sh builds it, then PATH")
    p.add_argument("--llama-cpp-model", default=None,
                   help="GGUF file for llama.cpp (default: the file tokenmill loads, when it loads a GGUF)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--plot", default=None, help="PNG of throughput against latency over a concurrency sweep")
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda a: _compare(a, engine_kwargs))


def _llm(args, engine_kwargs):
    from tokenmill import LLM

    return LLM(**engine_kwargs(args))


def _throughput(args, engine_kwargs) -> int:
    from tokenmill.bench.offline import build_requests, print_throughput, run_throughput

    llm = _llm(args, engine_kwargs)
    reqs = build_requests(args, llm)
    run_throughput(llm, reqs[: min(8, len(reqs))])  # warm-up
    result = run_throughput(llm, reqs)
    print_throughput(result)
    write_json(args.json, result)
    return 0


def _latency(args, engine_kwargs) -> int:
    from tokenmill.bench.offline import print_latency, run_latency

    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature must be 0 or more, --top-p in (0, 1]")
    llm = _llm(args, engine_kwargs)
    result = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.iters, args.warmup,
                         temperature=args.temperature, top_p=args.top_p)
    print_latency(result)
    write_json(args.json, result)
    return 0


def _serve(args) -> int:
    from tokenmill.bench.datasets import chat_requests, jsonl_requests, parse_range, random_requests
    from tokenmill.bench.serve import parse_goodput, print_summary, run_load, summarize

    out_range = parse_range(args.output_len)
    if args.dataset == "random":
        reqs = random_requests(args.num_prompts, parse_range(args.input_len), out_range, args.vocab_size, args.seed)
    else:
        from tokenmill.model.hub import resolve_model_path
        from tokenmill.model.loader import load_tokenizer

        tok = load_tokenizer(resolve_model_path(args.tokenizer))
        reqs = (chat_requests(args.num_prompts, tok, out_range, args.seed) if args.dataset == "chat"
                else jsonl_requests(args.dataset, tok, out_range, args.num_prompts, args.seed))
    goodput = parse_goodput(args.goodput)
    results, elapsed = asyncio.run(run_load(args.base_url, reqs, args.request_rate, args.max_concurrency,
                                            args.model, args.api_key, args.seed))
    summary = summarize(results, elapsed, goodput)
    print_summary(summary)
    write_json(args.json, summary)
    return 0 if summary["failed"] == 0 else 1


def _soak(args) -> int:
    from tokenmill.bench import soak

    return soak.main(args)


def _roofline(args, engine_kwargs) -> int:
    from tokenmill.bench.roofline import print_roofline, run_roofline

    result = run_roofline(_llm(args, engine_kwargs), args.context, args.prefill_len, args.repeats)
    print_roofline(result)
    write_json(args.json, result)
    return 0


def _compare(args, engine_kwargs) -> int:
    import statistics

    import torch

    from tokenmill.bench import compare
    from tokenmill.bench.datasets import parse_range

    args.input_range, args.output_range = parse_range(args.input_len), parse_range(args.output_len)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - {"decode", "prefill", "throughput"}
    if unknown:
        raise SystemExit(f"unknown workloads: {', '.join(sorted(unknown))} (decode, prefill, throughput)")
    llm = _llm(args, engine_kwargs)
    path, vocab, device = llm.engine.loaded.path, llm.engine.vocab_size, llm.engine.device
    dtype = compare.dtype_name(llm.engine.dtype)
    threads = torch.get_num_threads()
    stored = f"GGUF: {compare.gguf_weight_types(path)}" if path.endswith(".gguf") else "Hugging Face folder"
    engines = {"tokenmill": f"{path} ({stored}), run as {dtype}, {threads} threads, {device}"}
    print(f"tokenmill:    {engines['tokenmill']}")

    llama, llama_note = compare.llama_cpp_peer(path, threads, device, args.llama_cpp_dir, args.llama_cpp_model,
                                               enabled=not args.no_llama_cpp)
    hf = compare.TransformersProcess(path, dtype, threads, device=device)
    try:
        info = hf.info
        engines["transformers"] = (f"{path} loaded by transformers {info['transformers']} as {info['dtype']}, "
                                   f"{info['threads']} threads, {info['device']}, generate() in its own process "
                                   f"(pid {info['pid']})")
        print(f"transformers: {engines['transformers']}")
        engines["llama.cpp"] = llama_note
        print(f"llama.cpp:    {llama_note}")
        runners = [compare.TokenmillRunner(llm), hf] + ([llama] if llama else [])
        results, samples = {}, {}
        for workload in workloads:
            subset = runners
            if workload == "throughput":
                hf.batch_size = args.hf_batch_size or compare.best_static_batch(hf, vocab, args,
                                                                                on_gpu=device.type == "cuda")
                print(f"transformers static batch size: {hf.batch_size}")
                if llama:
                    print("llama.cpp: not in the throughput workload (llama-bench runs one sequence per test)")
                subset = [r for r in runners if r is not llama]
            runs = compare.measure_samples(subset, workload, vocab, args.repeats, args)
            hf.batch_size = 1
            figures = {name: statistics.median(v) for name, v in runs.items()}
            results[workload], samples[workload] = figures, runs
            base = figures["tokenmill"]
            unit = "output tok/s" if workload != "prefill" else "prompt tok/s"
            print(f"{workload}: " + ", ".join(
                f"{name} {value:.1f} {unit}" + ("" if name == "tokenmill" else f" (tokenmill {base / value:.2f}x)")
                for name, value in figures.items()))
        if llama and llama.last:
            engines["llama.cpp"] = f"{llama_note}; {llama.describe()}"
            print(f"llama.cpp:    {llama.describe()}")
        if args.plot:
            from tokenmill.bench.plot import concurrency_sweep_plot

            concurrency_sweep_plot(llm, hf, args, args.plot)
    finally:
        hf.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": dtype, "threads": threads, "engines": engines, "results": results,
                       "samples": samples}, f, indent=2)
    return 0
