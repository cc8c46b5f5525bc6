"""tokenmill serve | generate | chat | pull | models | bench | eval | export"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from tokenmill.server import reasoning


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file or known name (default: the built-in smollm2-135m-instruct)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto)")
    g.add_argument("--quantization", default="auto",
                   help="auto: run a quantized GGUF in its own formats; none: dequantize its weights to --dtype; "
                        "int8 / int4: quantize float weights at load, in groups of 32 (int8 on a GPU: a scale per "
                        "channel, torch's int8 product); int4-gptq: int4 fitted to a "
                        "calibration text at load (GPTQ: slower to load, closer to the float model); fp8: e4m3 "
                        "weights with a scale "
                        "per channel, for GPUs with FP8 products (default: auto)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size, e.g. 1GiB or 512MB (default 1GiB)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto: the KV cache in the model's dtype; int8 / fp8: 8-bit values with a scale per token "
                        "and KV head: head_dim + 2 bytes per token and KV head, about 1.9x the tokens of a bfloat16 "
                        "cache and 3.9x those of a float32 one in the same --kv-cache-memory (default: auto)")
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
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults of requests that leave them out. auto: the model's generation_config, "
                        "else the GGUF's sampling metadata, else a built-in model's recommended values, else "
                        "llama.cpp's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05); vllm: neutral OpenAI "
                        "defaults (temperature 1, no truncation); or a path to a generation_config.json or its "
                        "folder (default: auto)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='sampling defaults set over the chosen ones, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many processes on this host (heads and MLP rows), each with "
                        "its share of the CPUs; --kv-cache-memory is each one's (default 1)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt '
                        'lookup: proposals copied from earlier in the prompt or output, for outputs that quote '
                        'their input) or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'; '
                        'outputs are those of decoding without it (default: off)')


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching, num_scheduler_steps=args.num_scheduler_steps,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enforce_eager=args.enforce_eager, generation_config=args.generation_config,
                override_generation_config=_json_object(args.override_generation_config,
                                                        "--override-generation-config"),
                speculative_config=_json_object(args.speculative_config, "--speculative-config"))


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (unset: the defaults in force for the model, see --generation-config)")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=None, help="0 for greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.add_argument("--stats", action="store_true",
                   help="after each reply, print its token count, time to first token and tokens per second")


SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
            "max_tokens": int, "seed": int}


def sampling_params(args, llm):
    base = llm.get_default_sampling_params()
    changes = {"max_tokens": args.max_tokens, "stop": args.stop, "ignore_eos": args.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return base.clone(**changes)


@dataclass(slots=True)
class ReplyStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds from submission to the first token
    decode_seconds: float = 0.0  # from the first token to the last
    interrupted: bool = False

    def line(self) -> str:
        ttft = "-" if self.ttft is None else f"{self.ttft * 1000:.0f} ms"
        rate = (f"{(self.output_tokens - 1) / self.decode_seconds:.1f} tok/s"
                if self.output_tokens > 1 and self.decode_seconds > 0 else "- tok/s")
        end = ", interrupted" if self.interrupted else ""
        return f"[{self.prompt_tokens} prompt + {self.output_tokens} tokens, TTFT {ttft}, {rate}{end}]"


@contextlib.contextmanager
def ctrl_c_stops():
    """While generating: Ctrl-C sets the event (the loop aborts the request between steps) instead of
    raising inside a step, so no step is cut off half-way and the engine stays consistent."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def stream(llm, prompt, params, out=None, parser=None) -> tuple[str, ReplyStats]:
    """Generate one completion, writing its text to `out` (stdout) as it is produced. Ctrl-C stops it
    and aborts the request (its KV blocks are freed); the text so far is returned. With a reasoning
    parser (server/reasoning.py), the reasoning is shown dimmed and only the answer is returned."""
    out = out or sys.stdout
    engine = llm.engine
    stats = ReplyStats()
    start = time.perf_counter()
    shown, first, last = "", None, None
    show = _Shown(out, parser) if parser is not None else None
    with ctrl_c_stops() as stop:
        rid = engine.add_request(None, prompt, params)
        while engine.has_unfinished_requests():
            if stop.is_set():
                engine.abort_request(rid)
                stats.interrupted = True
                break
            for o in engine.step():
                if o.request_id != rid:
                    continue
                stats.prompt_tokens = len(o.prompt_token_ids)
                n = len(o.outputs[0].token_ids)
                if n > stats.output_tokens:
                    now = time.perf_counter()
                    first = first or now
                    last, stats.output_tokens = now, n
                text = o.outputs[0].text
                if show is not None:
                    show.feed(text, o.finished)
                else:
                    out.write(text[len(shown):])
                    out.flush()
                shown = text
    if first is not None:
        stats.ttft, stats.decode_seconds = first - start, last - first
    if show is not None:
        show.feed(shown, True)
        return show.answer, stats
    return shown, stats


class _Shown:
    """A reply's reasoning (dimmed on a terminal) and then its answer, as a reasoning parser splits them."""

    def __init__(self, out, parser) -> None:
        self.out, self.parser = out, parser
        self.dim = out.isatty() if hasattr(out, "isatty") else False
        self.answer, self.thinking = "", False

    def feed(self, text: str, final: bool) -> None:
        for d in self.parser.feed(text, final):
            if d.get("reasoning_content"):
                piece = d["reasoning_content"]
                self.out.write(f"\x1b[2m{piece}\x1b[0m" if self.dim else piece)
                self.thinking = True
            elif d.get("content"):
                if self.thinking:  # a blank line between the reasoning and the answer
                    self.out.write("\n\n")
                    self.thinking = False
                self.out.write(d["content"])
                self.answer += d["content"]
        self.out.flush()


def cmd_generate(args) -> int:
    from tokenmill import LLM

    if args.prompt is None and sys.stdin.isatty():
        print("Reading the prompt from standard input; end it with Ctrl-D.", file=sys.stderr)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = LLM(**engine_kwargs(args))
    _, stats = stream(llm, prompt, sampling_params(args, llm))
    sys.stdout.write("\n")
    if args.stats:
        print(stats.line(), file=sys.stderr)
    return 130 if stats.interrupted else 0


CHAT_HELP = """Commands:
  /help                 this text
  /reset                forget the conversation (the system message stays)
  /stats                show or hide each reply's stats line, and the KV cache's state
  /set NAME VALUE       change a sampling setting: temperature, top_p, top_k, min_p, repetition_penalty,
                        max_tokens, seed
  /show                 the sampling settings in force
  /exit, /quit, Ctrl-D  leave
A line ending with \\ continues on the next line; a line of \"\"\" starts and ends a multi-line message.
Ctrl-C stops a reply without leaving the chat (the interrupted turn is forgotten)."""


def read_message(read=input) -> str | None:
    """One message from the user: a line, lines joined by trailing backslashes, or a \"\"\" block.
    None at end of input."""
    try:
        line = read("> ")
        if line.strip() == '"""':
            lines = []
            while (line := read("... ")).strip() != '"""':
                lines.append(line)
            return "\n".join(lines)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = read("... ")
        return "\n".join(lines + [line])
    except EOFError:
        return None


@contextlib.contextmanager
def _history(path: str):
    """Input history (arrow keys, Ctrl-R) kept across chats, where readline exists."""
    try:
        import readline
    except ImportError:  # not on every platform
        yield
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)


def chat_command(line: str, state: dict, llm) -> str | None:
    """Run a /command; returns what to print (None: not a command)."""
    word, _, rest = line.strip().partition(" ")
    if word in ("/help", "/?"):
        return CHAT_HELP
    if word in ("/reset", "/clear"):
        state["messages"] = state["messages"][:1] if state["system"] else []
        return "(conversation forgotten)"
    if word == "/stats":
        state["stats"] = not state["stats"]
        kv = llm.engine.kv_manager.pool
        held = kv.num_blocks - kv.num_free
        return (f"(stats {'on' if state['stats'] else 'off'}; KV cache: {held} of {kv.num_blocks} blocks in use, "
                f"{len(kv.cached)} cached for reuse)")
    if word == "/show":
        p = state["params"]
        return ", ".join(f"{k}={getattr(p, k)}" for k in SETTABLE)
    if word == "/set":
        name, _, value = rest.strip().partition(" ")
        if name not in SETTABLE or not value.strip():
            return f"usage: /set NAME VALUE, NAME one of {', '.join(SETTABLE)}"
        try:
            state["params"] = state["params"].clone(**{name: SETTABLE[name](value.strip())})
        except ValueError as e:
            return f"error: {e}"
        return f"({name} = {getattr(state['params'], name)})"
    if word.startswith("/") and " " not in line.strip():
        return f"unknown command {word}; /help lists them"
    return None


def cmd_chat(args) -> int:
    from tokenmill import LLM
    from tokenmill.llm import apply_chat_template
    from tokenmill.model.hub import cache_dir

    llm = LLM(**engine_kwargs(args))
    kind = reasoning.kind_for(llm.get_tokenizer().chat_template, args.reasoning_parser)
    state = {"params": sampling_params(args, llm), "system": args.system, "stats": args.stats,
             "messages": [{"role": "system", "content": args.system}] if args.system else []}
    print("Chat with the model. /help lists commands; Ctrl-C stops a reply, Ctrl-D or /exit leaves.",
          file=sys.stderr)
    with _history(os.path.join(cache_dir(), "chat_history")):
        while True:
            try:
                text = read_message()
            except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
                print(file=sys.stderr)
                continue
            if text is None or text.strip() in ("/exit", "/quit"):
                if text is None:
                    print(file=sys.stderr)
                return 0
            if not text.strip():
                continue
            reply = chat_command(text, state, llm)
            if reply is not None:
                print(reply, file=sys.stderr)
                continue
            state["messages"].append({"role": "user", "content": text})
            try:
                prompt = apply_chat_template(llm.get_tokenizer(), state["messages"])
                parser = reasoning.new_parser(kind, prompt) if kind else None
                answer, stats = stream(llm, prompt, reasoning.request_params(kind, state["params"], llm.get_tokenizer()),
                                       parser=parser)
            except KeyboardInterrupt:  # before the reply started: nothing was queued
                answer, stats = "", ReplyStats(interrupted=True)
            except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep the chat
                print(f"error: {e}", file=sys.stderr)
                state["messages"].pop()
                continue
            print()
            if stats.interrupted:
                print("[interrupted]", file=sys.stderr)
                state["messages"].pop()
            else:
                state["messages"].append({"role": "assistant", "content": answer})
            if state["stats"]:
                print(stats.line(), file=sys.stderr)


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _describe_file(path: str) -> tuple[str, str]:
    """Format and licence of a model in the cache, as far as its own metadata says."""
    unknown = "unknown: see the model's terms"
    if not path.endswith(".gguf"):
        try:
            with open(os.path.join(path, "config.json")) as f:
                dtype = json.load(f).get("torch_dtype") or "float"
        except (OSError, ValueError):
            dtype = "float"
        return f"Hugging Face folder ({dtype})", unknown
    try:
        from tokenmill.model import gguf_loader

        reader = gguf_loader.GGUFFile(path)
        kinds = gguf_loader.quantized_types(reader) or sorted({t.tensor_type.name for t in reader.tensors})[:2]
        return "GGUF " + "/".join(kinds), str(reader.fields.get("general.license") or unknown)
    except Exception:  # a damaged or foreign file: list it anyway
        return "GGUF (unreadable header)", unknown


def cmd_models(args) -> int:
    from tokenmill.model.hub import DEFAULT_MODEL, NAMED_MODELS, cache_dir, cached_models

    cached = cached_models()
    have = {c.name for c in cached}
    rows = [("NAME", "SIZE", "FORMAT", "LICENCE", "STATE")]
    for name, spec in NAMED_MODELS.items():
        state = "cached" if name in have else "not fetched (tokenmill pull " + name + ")"
        rows.append((name + (" (default)" if name == DEFAULT_MODEL else ""), _size(spec.size), spec.format,
                     spec.license, state))
    for c in cached:
        if c.known is None:
            kind, licence = _describe_file(c.path)
            rows.append((c.name, _size(c.size), kind, licence, c.path))
    print(_table(rows))
    print(f"\nCache: {os.path.join(cache_dir(), 'models')} (set $TOKENMILL_CACHE to move it). Any local .gguf "
          "file or Hugging Face folder runs too: pass its path.")
    return 0


def cmd_pull(args) -> int:
    from tokenmill.llm import _configure_logging
    from tokenmill.model.hub import NAMED_MODELS, pull

    if args.name is None:
        rows = [("NAME", "SIZE", "FORMAT", "LICENCE", "DESCRIPTION")]
        rows += [(n, _size(m.size), m.format, m.license, m.description) for n, m in NAMED_MODELS.items()]
        print("Models tokenmill can fetch (tokenmill pull NAME):\n" + _table(rows))
        return 0
    _configure_logging()
    print(pull(args.name, force=args.force))
    return 0


def cmd_serve(args) -> int:
    from tokenmill.server.app import run_server

    return run_server(args)


def cmd_export_onnx(args) -> int:
    from tokenmill.export.onnx import export_onnx
    from tokenmill.llm import _configure_logging

    _configure_logging()
    print(export_onnx(args.model, args.out_dir))
    return 0


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
    p.add_argument("--reasoning-parser", default="auto", choices=reasoning.PARSERS,
                   help="show the model's reasoning dimmed, apart from its answer (as `serve --reasoning-parser`; "
                        "default auto: from the chat template)")
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="fetch a named model into the model cache (no name: list what can be fetched)")
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--force", action="store_true", help="fetch again even if cached")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list the built-in models and those in the model cache")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    from tokenmill.server.args import add_server_args

    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args, engine_kwargs)
    from tokenmill.eval import add_eval_parser

    add_eval_parser(sub, add_engine_args, engine_kwargs)

    p = sub.add_parser("export", help="write a model in another format")
    formats = p.add_subparsers(dest="export_format", required=True)
    q = formats.add_parser("onnx", help="an ONNX decoder graph with KV-cache inputs and outputs, in the layout of "
                                        "Hugging Face Optimum's exports (opset 14, float32), with its config.json "
                                        "and tokenizer files")
    q.add_argument("model", help="HF model folder, .gguf file (quantized weights are dequantized) or known name")
    q.add_argument("out_dir", help="folder to write model.onnx, config.json and the tokenizer files into")
    q.set_defaults(func=cmd_export_onnx)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "tensor_parallel_size", 1) > 1:
            _join_as_launched_rank(args)
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _join_as_launched_rank(args: argparse.Namespace) -> None:
    """Under torchrun, every rank runs the same command: a rank other than 0 serves rank 0's engine from
    here, on the main thread, and exits when it stops (it starts no server, chat or benchmark of its own)."""
    from tokenmill.distributed import launch

    launched = launch.launched_world()
    if launched and launched[0] > 0:
        from tokenmill.config import EngineConfig

        launch.join(EngineConfig(**engine_kwargs(args)))


if __name__ == "__main__":
    sys.exit(main())
