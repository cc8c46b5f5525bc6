"""tokenmill: an LLM inference engine with paged KV cache, continuous batching and an OpenAI-compatible server."""

from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import GuidedDecodingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]
