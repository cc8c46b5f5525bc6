"""Request bodies of the OpenAI API (plus vLLM's extras), and their translation to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured.params import StructuredOutputsParams


class FieldError(ValueError):
    """A bad value, with the request field it came from (the error's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI clients expect


class StreamOptions(_Body):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's: usage so far on every chunk


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _SamplingBody(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extras (sent by the openai client through extra_body)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Optional[str] = None
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N", never ambiguous
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for, and the field it came from; FieldError (a 400
        naming the field) for a bad or doubled one."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise FieldError("response_format of type json_schema needs json_schema.schema", "response_format")
            given.append(("response_format", {"json": rf.json_schema.schema_, "strict": bool(rf.json_schema.strict)}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                given.append((name, {kind: getattr(self, name)}))
        if not given:
            return None, None
        if len(given) > 1:
            raise FieldError(f"give one output constraint, not {' and '.join(n for n, _ in given)}", given[1][0])
        name, value = given[0]
        try:
            return StructuredOutputsParams.coerce(value), name
        except (ValueError, TypeError) as e:
            raise FieldError(f"{name}: {e}", name) from None

    def to_sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """Fields the request leaves out take the model's defaults (generation_config)."""
        def pick(value, default):
            return default if value is None else value

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from e
        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, defaults.temperature), top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k), min_p=pick(self.min_p, defaults.min_p),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt,
            structured_outputs=self.structured()[0],
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(_SamplingBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool result's call
    # an assistant's earlier reasoning, under the names clients send it back by
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    thinking: Optional[str] = None

    def as_dict(self) -> dict:
        m = {"role": self.role, "content": self.text()}
        thought = self.reasoning_content or self.reasoning or self.thinking
        if thought:  # templates read it as reasoning_content (Qwen3) or thinking (gpt-oss)
            m["reasoning_content"] = m["thinking"] = thought
        if self.tool_calls:
            for c in self.tool_calls:
                if not isinstance(c.get("function"), dict) or not isinstance(c["function"].get("name"), str):
                    raise ValueError("each tool_calls entry needs function.name and function.arguments")
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            m["name"] = self.name
        return m

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is understood
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"message content of type {part.get('type')!r} is not supported; send text")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    chat_template: Optional[str] = None
    add_generation_prompt: bool = True
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the template (enable_thinking)
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None  # the template's reasoning_effort
    include_reasoning: bool = True  # False: the reasoning is parsed off and not returned (vLLM's switch)

    def template_kwargs(self) -> dict[str, Any]:
        """Variables the chat template gets besides messages and tools; FieldError for a reserved name."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise FieldError(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


# what the server itself passes to the chat template
_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "tokenize", "continue_final_message", "return_dict", "return_assistant_tokens_mask"}


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
