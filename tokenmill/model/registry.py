"""Architecture name (as in a config's "architectures") -> model class."""

from __future__ import annotations

from tokenmill.model.gemma2 import Gemma2ForCausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.gpt_oss import GptOssForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mistral import MistralForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.qwen2 import Qwen2ForCausalLM
from tokenmill.model.qwen2_moe import Qwen2MoeForCausalLM
from tokenmill.model.qwen3 import Qwen3ForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(hf_config: dict) -> type:
    """The class for a config, or a ValueError naming the supported architectures."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {archs or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(sorted(MODELS))}")
