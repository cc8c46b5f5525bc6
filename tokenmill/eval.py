"""tokenmill eval perplexity: a model's perplexity over a text, scored as llama.cpp's llama-perplexity does.

The text is tokenized once and cut into windows of ctx tokens, `stride` apart (default ctx: back-to-back
chunks). Each window is one prompt; the engine returns every prompt token's logprob, and the tokens in the
window's second half (at least ctx/2 tokens of context before each; with a stride under ctx/2, only the
tokens no earlier window scored) are counted. Where the tokenizer starts sequences with BOS, each window's
first token is replaced by BOS, as llama-perplexity does. Perplexity = exp(mean negative logprob).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    stderr: float  # of the perplexity, from the spread of the token losses
    tokens_scored: int
    windows: int
    ctx: int
    text_tokens: int

    def __str__(self) -> str:
        return (f"perplexity {self.perplexity:.4f} +/- {self.stderr:.4f} over {self.tokens_scored} tokens "
                f"({self.windows} windows of {self.ctx} tokens; text {self.text_tokens} tokens)")


def windows(tokens: list[int], ctx: int, stride: int, bos: int | None) -> list[tuple[list[int], int]]:
    """(window tokens, index of the first scored position) for each window."""
    if ctx < 2 or not 1 <= stride <= ctx:
        raise ValueError(f"need ctx >= 2 and 1 <= stride <= ctx, got ctx {ctx}, stride {stride}")
    if len(tokens) < ctx:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of {ctx}")
    first = max(ctx // 2, ctx - stride)
    out = []
    for start in range(0, len(tokens) - ctx + 1, stride):
        w = list(tokens[start:start + ctx])
        if bos is not None:
            w[0] = bos
        out.append((w, first))
    return out


def sequence_bos(tokenizer) -> int | None:
    """The tokenizer's BOS id where it starts sequences with it, else None."""
    probe = tokenizer.encode("a")
    bos = tokenizer.bos_token_id
    return bos if bos is not None and probe and probe[0] == bos else None


def perplexity(llm, text: str, ctx: int = 512, stride: int | None = None, max_windows: int | None = None,
               progress: bool = True) -> PerplexityResult:
    from tokenmill import SamplingParams

    tok = llm.get_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    bos = sequence_bos(tok)
    stride = ctx if stride is None else stride
    wins = windows(ids, ctx, stride, bos)[:max_windows]
    outs = llm.generate([w for w, _ in wins], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=progress)
    losses = []
    for (w, first), out in zip(wins, outs):
        for pos in range(max(first, 1), ctx):
            losses.append(-out.prompt_logprobs[pos][w[pos]].logprob)
    n = len(losses)
    mean = sum(losses) / n
    var = sum((x - mean) ** 2 for x in losses) / max(n - 1, 1)
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * math.sqrt(var / n), n, len(wins), ctx, len(ids))


def add_eval_parser(sub, add_engine_args, engine_kwargs) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    evals = p.add_subparsers(dest="eval_command", required=True)
    q = evals.add_parser("perplexity", help="perplexity over a text, scored as llama.cpp's llama-perplexity does")
    add_engine_args(q)
    q.add_argument("--text", default=None,
                   help="UTF-8 text file (default: Alice's Adventures in Wonderland, public domain, ~35k tokens, "
                        "fetched once from the brotli 1.2.1 source archive on PyPI; see tokenmill/data)")
    q.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    q.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: ctx, back-to-back windows as llama-perplexity)")
    q.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")

    def run(args: argparse.Namespace) -> int:
        from tokenmill import LLM

        text = read_text(args.text)
        kwargs = engine_kwargs(args)
        kwargs["enable_prefix_caching"] = False
        llm = LLM(**kwargs)
        print(perplexity(llm, text, args.ctx, args.stride, args.max_windows))
        return 0

    q.set_defaults(func=run)


def read_text(path: str | None) -> str:
    if path is None:
        from tokenmill.data import default_text

        return default_text()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the text {path!r}: {e}") from None
