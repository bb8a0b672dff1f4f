"""Architecture name (``config.architectures[0]``) -> model class, and how each was verified.

Every entry here is checked token for token against Hugging Face transformers on tiny random
weights through the engine (tests/engine/test_hf_equivalence.py, tests/model/test_models_vs_hf.py);
``VERIFIED_BY`` names the test, for ``pagedllm models`` and the README.
"""

from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from pagedllm.model.phi3 import Phi3ForCausalLM
from pagedllm.model.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in ``architectures``; ModelLoadError if none."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ModelLoadError(
        f"unsupported model architecture {architectures!r}; supported: {', '.join(supported_architectures())}"
    )
