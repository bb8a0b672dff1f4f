"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, each a Llama-like decoder whose MLP is a
sparse MoE (layers/moe.py).

- Qwen3-MoE: Qwen3's attention (q/k norm); an MoE MLP on every ``decoder_sparse_step``-th layer
  not in ``mlp_only_layers`` (a dense MLP there); top-k weights renormalised iff ``norm_topk_prob``.
- Mixtral: Mistral's attention (its sliding window honoured); MoE on every layer, always
  renormalised; checkpoints name the block ``block_sparse_moe`` and the projections w1 (gate),
  w3 (up), w2 (down).

Under tensor parallelism each rank holds every expert sliced along the intermediate dimension
(layers/moe.py says why that over expert parallelism); the router is replicated.
"""

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.model.layers.moe import SparseMoE
from pagedllm.model.llama import DecoderSpec, LlamaForCausalLM, LlamaMLP, llama_spec


def _sparse_moe(config, intermediate_size: int, num_experts: int, renormalize: bool) -> SparseMoE:
    return SparseMoE(config.hidden_size, intermediate_size, num_experts, config.num_experts_per_tok, renormalize,
                     config.hidden_act, tp_size=get_tp_size(), tp_rank=get_tp_rank())


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        return replace(llama_spec(config), qk_norm=True)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(config, self.spec)
        return _sparse_moe(config, config.moe_intermediate_size, config.num_experts, bool(config.norm_topk_prob))


_MIXTRAL_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return _sparse_moe(config, config.intermediate_size, config.num_local_experts, True)

    def hf_weights(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        expert = _MIXTRAL_EXPERT.match(name)
        if expert is not None:
            prefix, index, proj = expert.groups()
            yield f"{prefix}.mlp.experts.{index}.{_MIXTRAL_PROJ[proj]}.weight", tensor
        else:
            yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
