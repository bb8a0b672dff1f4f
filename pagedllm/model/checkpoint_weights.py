"""Hugging Face-named checkpoint tensors into a Llama-like model's parameters, and the keys a complete load sets.

A checkpoint names q, k, v and gate, up apart; the model holds them fused (``qkv_proj``, ``gate_up_proj``), so
each lands in its shard of the fused parameter (``model.stacked_params``: HF fragment -> our fragment, shard id),
and a load counts ``<param>#<shard>`` keys. A mixture of experts' per-expert projections land in the layer's
stacked expert weights (``w13``, ``w2``), one key per expert (and gate/up half). ``model.hf_weights`` first
renames or splits a family's own checkpoint names into Llama's.
"""

import re
from collections.abc import Iterable

import torch

from pagedllm.model.layers.linear import default_weight_loader


def load_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load Hugging Face-named tensors into ``model``; returns the names of its parameters that were set."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for checkpoint_name, checkpoint_tensor in weights:
        for name, tensor in model.hf_weights(checkpoint_name, checkpoint_tensor):
            _load_one(model, params, loaded, name, tensor)
    return loaded


def _load_one(model, params: dict, loaded: set[str], name: str, tensor: torch.Tensor) -> None:
    if "rotary_emb.inv_freq" in name:
        return
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return
    expert = _EXPERT_WEIGHT.match(name)
    if expert is not None:  # one expert's projection: a slice of the layer's stacked expert weights
        prefix, index, proj = expert.groups()
        target, part = (f"{prefix}.w2", None) if proj == "down_proj" else (f"{prefix}.w13", proj == "up_proj")
        if target not in params:
            raise KeyError(f"unexpected weight {name!r}")
        shard_id = (int(index), int(part)) if part is not None else (int(index),)
        params[target].weight_loader(params[target], tensor, shard_id)
        loaded.add(f"{target}#{'.'.join(map(str, shard_id))}")
        return
    for hf_part, our_part, shard_id in model.stacked_params:
        if hf_part in name:
            target = name.replace(hf_part, our_part)
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            param = params[target]
            param.weight_loader(param, tensor, shard_id)  # copy_ casts to param.dtype
            loaded.add(f"{target}#{shard_id}")
            return
    if name not in params:
        raise KeyError(f"unexpected weight {name!r}")
    param = params[name]
    loader = getattr(param, "weight_loader", default_weight_loader)
    loader(param, tensor)
    loaded.add(name)


def expected_weight_keys(model) -> set[str]:
    """The keys ``load_weights`` returns when every parameter of ``model`` was set."""
    keys = set()
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        shard_ids = getattr(param, "shard_ids", None)
        if shard_ids is not None:  # stacked expert weights: one key per expert (and gate/up half)
            keys.update(f"{name}#{'.'.join(map(str, s))}" for s in shard_ids)
        elif ".qkv_proj." in name:
            keys.update(f"{name}#{s}" for s in "qkv")
        elif ".gate_up_proj." in name:
            keys.update(f"{name}#{s}" for s in (0, 1))
        else:
            keys.add(name)
    return keys


# ``<layer>.mlp.experts.<index>.<gate|up|down>_proj.weight`` (Qwen3-MoE names; mixtral.py renames its own)
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
