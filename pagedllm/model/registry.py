"""Architecture name (``config.architectures[0]``) -> model class, and how each was verified.

Every entry here is checked token for token against Hugging Face transformers on tiny random
weights through the engine; ``VERIFIED_BY`` says how, for ``pagedllm models`` and docs/models.md
(tests/model/test_models_vs_hf.py fails if an architecture lacks its line).
"""

from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model.base_model import base_model_of
from pagedllm.model.bert import (BertForSequenceClassification, BertModel, RobertaForSequenceClassification,
                                 RobertaModel)
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
    # head-less checkpoints (decoder embedders saved by sentence-transformers): pooling only
    "LlamaModel": base_model_of(LlamaForCausalLM),
    "Qwen2Model": base_model_of(LlamaForCausalLM),
    "Qwen3Model": base_model_of(Qwen3ForCausalLM),
    # encoders (bidirectional, no KV cache): pooling only
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    # cross-encoders: score text pairs
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
}


_LLAMA_CHECK = ("greedy tokens equal to HF transformers and logprobs within 1e-3 on tiny random weights, "
                "through the engine: one batch, chunked prefill, preemption")
_ENGINE_CHECK = f"{_LLAMA_CHECK}, prefix-cache hits"
VERIFIED_BY: dict[str, str] = {
    "LlamaForCausalLM": f"{_LLAMA_CHECK} (tests/engine/test_hf_equivalence.py, GQA); logits of tied "
                        "embeddings and llama3 rope (tests/model/test_llama_vs_hf.py); GGUF F32 twin "
                        "(tests/model/test_gguf.py)",
    "MistralForCausalLM": f"{_ENGINE_CHECK}, sliding window 16 on prompts to 8x it "
                          "(tests/model/test_models_vs_hf.py[mistral_window])",
    "Qwen2ForCausalLM": f"{_LLAMA_CHECK} (tests/engine/test_hf_equivalence.py, q/k/v bias)",
    "Qwen3ForCausalLM": f"{_ENGINE_CHECK} (tests/model/test_models_vs_hf.py[qwen3]); GGUF F32 twin "
                        "(tests/model/test_gguf_qwen3.py)",
    "Qwen3MoeForCausalLM": f"{_ENGINE_CHECK}, 8 experts top-2, norm_topk_prob on and off, a dense layer "
                           "(tests/model/test_models_vs_hf.py[qwen3_moe*]); GGUF qwen3moe F16 and "
                           "Q8_0 twins (tests/model/test_gguf_archs.py[qwen3_moe-*])",
    "MixtralForCausalLM": f"{_ENGINE_CHECK}, 4 experts top-2, sliding window 16 "
                          "(tests/model/test_models_vs_hf.py[mixtral]); GGUF llama-with-experts F16 and "
                          "Q8_0 twins (tests/model/test_gguf_archs.py[mixtral-*])",
    "Gemma2ForCausalLM": f"{_ENGINE_CHECK}, local/global layers (window 16), both soft-caps "
                         "(tests/model/test_models_vs_hf.py[gemma2]); GGUF gemma2 F16 and Q8_0 twins "
                         "(tests/model/test_gguf_archs.py[gemma2-*])",
    "Gemma3ForCausalLM": f"{_ENGINE_CHECK}, 3 local (window 16) : 1 global, two rotary bases, q/k norms "
                         "(tests/model/test_models_vs_hf.py[gemma3]); GGUF gemma3 F16 and Q8_0 twins "
                         "(tests/model/test_gguf_archs.py[gemma3-*])",
    "Phi3ForCausalLM": f"{_ENGINE_CHECK}, fused weights, longrope below the original length "
                       "(tests/model/test_models_vs_hf.py[phi3]); GGUF phi3 F16 and Q8_0 twins "
                       "(tests/model/test_gguf_archs.py[phi3-*])",
    **{arch: "pooled vectors equal to sentence-transformers' (cosine > 0.9999, max abs diff < 1e-4) for mean and "
             "last-token pooling, Dense and Normalize, chunked prefill (tests/engine/test_embeddings.py)"
       for arch in ("LlamaModel", "Qwen2Model", "Qwen3Model")},
    **{arch: "pooled vectors equal to sentence-transformers' (cosine > 0.9999, max abs diff < 1e-4) for CLS and "
             "mean pooling on ragged batches (tests/engine/test_encoders.py)"
       for arch in ("BertModel", "RobertaModel", "XLMRobertaModel")},
    **{arch: "scores equal to sentence-transformers' CrossEncoder.predict (abs diff < 1e-5) on ragged pairs "
             "(tests/engine/test_cross_encoders.py)"
       for arch in ("BertForSequenceClassification", "RobertaForSequenceClassification",
                    "XLMRobertaForSequenceClassification")},
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
