"""Phi-3 (and Phi-3.5/Phi-4-mini text checkpoints with full rotary): a Llama whose checkpoints fuse
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; split here at load, so tensor
parallelism shards them like any Llama's. ``longrope`` scaling: layers/rotary.py."""

from collections.abc import Iterable

import torch

from pagedllm.distributed.shapes import head_dim_of, num_kv_heads_of
from pagedllm.model.layers.linear import materialize
from pagedllm.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def hf_weights(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            tensor = materialize(tensor)  # a lazy checkpoint slice; these are split whole
        if ".self_attn.qkv_proj." in name:
            q_size = config.num_attention_heads * head_dim_of(config)
            kv_size = num_kv_heads_of(config) * head_dim_of(config)
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            for part, piece in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield name.replace(".qkv_proj.", f".{part}."), piece
        elif ".mlp.gate_up_proj." in name:
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor
