"""Whether a long prompt's greedy answer depends on how its prompt was split into chunks: 4 chat prompts of
~500 tokens (passages of the built-in evaluation text, tokenmill.data, to repeat), 48 greedy tokens each,
computed whole by one
engine and in chunks of 96 tokens by another (max_num_batched_tokens 96), no prefix cache; prints, per
prompt, whether the two answers are the same tokens or from which position they differ. In a server the
chunks a prompt gets depend on what else is running, so where they differ the same request can answer
differently from one run to the next.

    python benchmarks/chunk_invariance.py [MODEL]                                   # the kernels' attention
    TOKENMILL_PROMPT_ATTENTION=torch python benchmarks/chunk_invariance.py [MODEL]  # torch's
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.data import default_text
    from tokenmill.model.hub import pull

    model = sys.argv[1] if len(sys.argv) > 1 else pull()
    text = default_text()
    chats = [[{"role": "user", "content": "Repeat this text exactly:\n\n" + text[20000 * i:20000 * i + 2000]}]
             for i in range(1, 5)]
    params = SamplingParams(temperature=0, max_tokens=48)
    answers = {}
    for name, options in (("whole", {}), ("chunked", {"max_num_batched_tokens": 96, "long_prefill_token_threshold": 96})):
        llm = LLM(model, enable_prefix_caching=False, kv_cache_memory="256MiB", **options)
        answers[name] = [llm.chat([chat], params, use_tqdm=False)[0] for chat in chats]
        del llm
    print(f"prompt attention: {os.environ.get('TOKENMILL_PROMPT_ATTENTION', 'kernel (default)')}")
    for whole, chunked in zip(answers["whole"], answers["chunked"]):
        a, b = whole.outputs[0].token_ids, chunked.outputs[0].token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"prompt of {len(whole.prompt_token_ids)} tokens: " +
              ("the same tokens" if list(a) == list(b) else f"the answers differ from token {first}"))


if __name__ == "__main__":
    main()
