"""LLM: the offline Python API over the engine."""

from __future__ import annotations

import logging
from typing import Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

_PROGRESS_MIN = 16  # show a progress bar for batches at least this large


class LLM:
    """Generate text for many prompts at once with continuous batching.

    LLM() loads the built-in default model; LLM("path") a Hugging Face folder or a .gguf file.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, kv_cache_memory: int | str = "1GiB",
                 block_size: int = 16, seed: int = 0, enable_prefix_caching: bool = True, device: str = "auto",
                 **kwargs) -> None:
        _configure_logging()
        self.config = EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                                   block_size=block_size, seed=seed, enable_prefix_caching=enable_prefix_caching,
                                   device=device, **kwargs)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: str | dict | Sequence[int] | Sequence[str | dict] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids":
        ...} dicts); outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} prompts; "
                                 "pass one, or one per prompt")
        # Validate everything before any work starts, then queue.
        encoded = [self.engine.encode(p) for p in prompt_list]
        ids = []
        try:
            for p, e, sp in zip(prompt_list, encoded, params):
                ids.append(self.engine.add_request(None, p, sp, prompt_token_ids=e))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= _PROGRESS_MIN)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.engine.tokenizer, c, chat_template, add_generation_prompt,
                                       chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finals])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[i] for i in ids]


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, tools: list[dict] | None = None,
                        chat_template_kwargs: dict | None = None) -> str:
    """Render a conversation with the model's chat template (transformers renders it in a Jinja sandbox);
    chat_template_kwargs are more variables for it (enable_thinking, reasoning_effort)."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template; pass chat_template= or use generate() with plain text")
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         **(chat_template_kwargs or {}))


def _as_prompt_list(prompts) -> list:
    """Prompts as strings or token-id lists. Takes vLLM's prompt forms: a string, a list of token ids, a dict
    {"prompt": str} or {"prompt_token_ids": [ids]}, or a list of any of these."""
    if isinstance(prompts, (str, dict)):
        return [_as_prompt(prompts)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt of token ids
    return [_as_prompt(p) for p in prompts]


def _as_prompt(prompt):
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt_token_ids"} or keys == {"prompt_token_ids", "prompt"}:
        return list(prompt["prompt_token_ids"])
    if keys == {"prompt"}:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (a list of ids); got keys "
                     f"{sorted(keys)}")


def _configure_logging() -> None:
    root = logging.getLogger("tokenmill")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
