"""Decoders saved without their language-model head (`Qwen3Model`, `LlamaModel`, ...): the checkpoints
sentence-transformers writes for decoder embedders. The same network as the causal LM, its tensors
named without the `model.` prefix; no `lm_head`, so such a model can only be pooled."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def base_model_of(causal_lm_cls: type[nn.Module]) -> type[nn.Module]:
    """`causal_lm_cls` loading a head-less checkpoint: tensor names get `model.`, the head is not expected."""

    class BaseModel(causal_lm_cls):
        has_lm_head = False
        """Nothing to compute logits with: the engine refuses to generate from it."""

        def hf_weights(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
            yield from super().hf_weights(name if name.startswith("model.") else f"model.{name}", tensor)

        def expected_weight_keys(self) -> set[str]:
            return {key for key in super().expected_weight_keys() if not key.startswith("lm_head.")}

    BaseModel.__name__ = BaseModel.__qualname__ = causal_lm_cls.__name__.replace("ForCausalLM", "Model")
    return BaseModel
