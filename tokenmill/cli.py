"""tokenmill serve | generate | chat | pull | bench"""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file or known name (default: the built-in smollm2-135m-instruct)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    g.add_argument("--quantization", default="auto",
                   help="auto: run a quantized GGUF in its own formats; none: dequantize its weights to --dtype; "
                        "int8 / int4: quantize float weights at load, in groups of 32 (default: auto)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size, e.g. 1GiB or 512MB (default 1GiB)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of repeated prompt prefixes (default: on)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=512,
                   help="while requests decode, cap one request's prompt chunk per step at this many tokens, so "
                        "decodes are not held up by long prompts (default 512; 0: no cap)")
    g.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="greedy decode steps run back to back per engine step on the CPU kernels (default 8; 1: "
                        "one at a time, outputs token by token)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching, num_scheduler_steps=args.num_scheduler_steps,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enforce_eager=args.enforce_eager)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=None, help="0 for greedy (default: the model's)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args, llm):
    base = llm.get_default_sampling_params()
    changes = {"max_tokens": args.max_tokens, "stop": args.stop}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return base.clone(**changes)


def stream(llm, prompt, params) -> str:
    """Generate one completion and write its text to stdout as it is produced."""
    engine = llm.engine
    rid = engine.add_request(None, prompt, params)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    except KeyboardInterrupt:
        engine.abort_request(rid)
        raise
    return shown


def cmd_generate(args) -> int:
    from tokenmill import LLM

    llm = LLM(**engine_kwargs(args))
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    stream(llm, prompt, sampling_params(args, llm))
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from tokenmill import LLM
    from tokenmill.llm import apply_chat_template

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args, llm)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model. /reset forgets the conversation, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = apply_chat_template(llm.get_tokenizer(), messages)
        try:
            reply = stream(llm, prompt, params)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_pull(args) -> int:
    from tokenmill.llm import _configure_logging
    from tokenmill.model.hub import pull

    _configure_logging()
    print(pull(args.name, force=args.force))
    return 0


def cmd_serve(args) -> int:
    from tokenmill.server.app import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt, streaming the text to the terminal")
    add_engine_args(p)
    p.add_argument("--prompt", "-p", default=None, help="the prompt (default: read standard input)")
    add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal using the model's chat template")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="fetch a named model into the model cache")
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--force", action="store_true", help="fetch again even if cached")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    from tokenmill.server.args import add_server_args

    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args, engine_kwargs)
    from tokenmill.eval import add_eval_parser

    add_eval_parser(sub, add_engine_args, engine_kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
