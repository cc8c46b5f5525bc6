"""tokenmill: an LLM inference engine with paged KV cache, continuous batching and an OpenAI-compatible server."""

import os

# MKL's float32 GEMM (torch's on x86 CPUs) gives other last bits on another number of threads for some shapes
# (a few rows: 5 x 1024 by 1024 x 1024 moved by 5e-5). The engine runs a step on one thread while another
# process holds a core (kernels/cpu.py, ThreadGovernor), and its outputs must not change with that: MKL's
# strict reproducible mode keeps the bits whatever the thread count, at no measured cost. MKL reads this when
# it starts (its first call), so it must be set before any: importing tokenmill first does that.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import GuidedDecodingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]
