"""Llama-family decoder (Llama, Mistral, Qwen2) over flat token batches and paged KV caches.

``forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]``; the attention layers find
the step's metadata and KV caches in the forward context. Differences handled here:
GQA, ``head_dim`` from the config, q/k/v bias (Qwen2, or Llama's ``attention_bias``),
tied embeddings, rope scaling. Tensor parallelism comes from pagedllm.distributed (set before
the model is built): each rank builds only its shard. Mistral/Qwen2 sliding-window attention is ignored (full attention),
which is exact for contexts shorter than the window.
"""

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.distributed.shapes import check_config_tp_size, head_dim_of as _head_dim
from pagedllm.model.attention.layer import Attention
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding


class _DirectChildren(nn.Module):
    """Keeps each child module in the instance ``__dict__`` too, so ``self.child`` in a forward is a
    plain attribute read: otherwise every such read misses and runs ``nn.Module.__getattr__``
    (~0.5-0.9 us; about a dozen a layer per step). The child still lives in ``_modules`` (state
    dicts, ``.to()``, hooks and ``__call__`` are unchanged); assigning, adding or deleting a child
    refreshes the copy, so it never goes stale."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self._refresh_child(name)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self._refresh_child(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        self._refresh_child(name)

    register_module = add_module

    def _refresh_child(self, name: str) -> None:
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            self.__dict__[name] = modules[name]
        elif modules is not None:
            child = self.__dict__.get(name)
            if isinstance(child, nn.Module):  # a stale copy of a removed child
                del self.__dict__[name]


class LlamaAttention(_DirectChildren):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type == "qwen2"
        tp = dict(tp_size=get_tp_size(), tp_rank=get_tp_rank())
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias, **tp
        )
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size, bias=attention_bias, **tp)
        self.rotary = rotary  # shared by all layers
        # This rank's heads: [T, H/tp, D] queries over [T, Hkv/tp (at least 1), D] keys and values. Kept as
        # plain ints: reading them off qkv_proj goes through nn.Module.__getattr__ at every step.
        self.num_local_heads = self.qkv_proj.num_heads
        self.num_local_kv_heads = self.qkv_proj.num_kv_heads
        self.attn = Attention(layer_idx, self.num_local_heads, self.num_local_kv_heads, self.head_dim,
                              self.head_dim**-0.5)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        # [T, H, D], [T, Hkv, D], [T, Hkv, D]; queries and keys rotated
        q, k, v = self.rotary.rotate_qkv(qkv, cos_sin, self.num_local_heads, self.num_local_kv_heads)
        out = self.attn(q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(_DirectChildren):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        tp = dict(tp_size=get_tp_size(), tp_rank=get_tp_rank())
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, **tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(_DirectChildren):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(_DirectChildren):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, get_tp_size(), get_tp_rank())
        self.rotary = rotary = RotaryEmbedding(config, _head_dim(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        cos_sin = self.rotary.cos_sin(positions, hidden_states.dtype)  # once per step, for every layer
        for layer in self.layers:
            hidden_states, residual = layer(cos_sin, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (our fused parameter fragment, shard id)
    stacked_params = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    def __init__(self, config):
        super().__init__()
        check_config_tp_size(config, get_tp_size())
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, get_tp_size(), get_tp_rank())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held (and cached) by this rank."""
        return self.model.layers[0].self_attn.qkv_proj.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.compute_logits(hidden_states)

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] int64, each row's argmax of compute_logits computed without the float32
        logits (layers/greedy_head.py), or None where that does not apply: call compute_logits."""
        return self.lm_head.greedy_token_ids(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of our parameters that were set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for hf_part, our_part, shard_id in self.stacked_params:
                if hf_part in name:
                    target = name.replace(hf_part, our_part)
                    if target not in params:
                        raise KeyError(f"unexpected weight {name!r}")
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)  # copy_ casts to param.dtype
                    loaded.add(f"{target}#{shard_id}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor)
                loaded.add(name)
        return loaded

    def process_weights_after_loading(self) -> None:
        """Lay weights out for the fastest GEMM on their device; call once, after the last weight,
        dtype or device change (the loader does). Values and shapes stay as loaded."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def expected_weight_keys(self) -> set[str]:
        """The keys ``load_weights`` returns when every parameter was set."""
        keys = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if ".qkv_proj." in name:
                keys.update(f"{name}#{s}" for s in "qkv")
            elif ".gate_up_proj." in name:
                keys.update(f"{name}#{s}" for s in (0, 1))
            else:
                keys.add(name)
        return keys
