"""PEFT LoRA adapters from disk: ``adapter_config.json`` checked (``read_adapter_config``, no weights read)
and ``adapter_model.safetensors`` read into per-projection ``(A, B * scaling)`` pairs (``load_adapter``).

PEFT's delta on a linear is ``lora_B(lora_A(x)) * scaling`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); the scaling is folded into B once, here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.lora.request import LoRAError

if TYPE_CHECKING:
    import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target: Hugging Face names of the linears in model/llama.py."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_UNSUPPORTED = {  # config key -> (value that is fine, why the rest is refused)
    "use_dora": (False, "DoRA adapters are not supported"),
    "bias": ("none", "adapters that train biases are not supported"),
    "modules_to_save": (None, "adapters with modules_to_save (full copies of layers) are not supported"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not supported"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out adapters are not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
}


@dataclass(frozen=True)
class AdapterConfig:
    """What serving needs of an adapter_config.json."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...] | None
    """The projections named in the config (None: a regex; the weights say which)."""


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """Check that `path` holds a PEFT LoRA adapter this engine can serve; LoRAError naming the reason if not."""
    directory = Path(path)
    if not directory.exists():
        raise LoRAError(f"LoRA adapter path {path!r} does not exist")
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"{path!r} is not a PEFT LoRA adapter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{path!r}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path!r} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    for key, (fine, why) in _UNSUPPORTED.items():
        value = config.get(key, fine)
        if value and value != fine:
            raise LoRAError(f"{path!r}: {why}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{path!r}: {CONFIG_FILE} has no valid rank 'r' ({rank!r})")
    if rank > max_lora_rank:
        raise LoRAError(f"{path!r}: the adapter's rank {rank} exceeds max_lora_rank ({max_lora_rank}); "
                        f"raise --max-lora-rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) \
            or abs(alpha) > 1e6:
        raise LoRAError(f"{path!r}: {CONFIG_FILE} has lora_alpha {alpha!r}, not a finite number of sane size")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoRAError(f"{path!r}: target modules {unknown} are not in the model (LoRA can patch "
                            f"{', '.join(PROJECTIONS)})")
        targets = tuple(targets)
    else:
        targets = None
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return AdapterConfig(rank, float(scaling), targets)


@dataclass
class LoRAWeights:
    """One adapter, read: (layer index, HF projection name) -> (A [r, in], B * scaling [out, r])."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str, max_lora_rank: int, num_layers: int) -> LoRAWeights:
    """Read and check an adapter's weights (float32, CPU); LoRAError naming what does not fit the model."""
    import torch
    from safetensors import safe_open

    from pagedllm.errors import InvalidModelFileError
    from pagedllm.model.checkpoint_validate import check_safetensors

    config = read_adapter_config(path, max_lora_rank)
    try:
        check_safetensors(Path(path) / WEIGHTS_FILE)  # its header, before safetensors maps the file
    except InvalidModelFileError as e:
        raise LoRAError(str(e)) from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():
                match = _WEIGHT.search(name)
                if match is None:
                    raise LoRAError(f"{path!r}: weight {name!r} patches a module the model does not have")
                layer, proj, half = int(match[1]), match[2], match[3]
                if proj not in PROJECTIONS:
                    raise LoRAError(f"{path!r}: target module {proj!r} is not in the model")
                if layer >= num_layers:
                    raise LoRAError(f"{path!r}: weight {name!r} is for layer {layer}; the model has {num_layers}")
                halves.setdefault((layer, proj), {})[half] = f.get_tensor(name).to(torch.float32)
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
        raise LoRAError(f"{path!r}: cannot read {WEIGHTS_FILE}: {e}") from None
    weights = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{path!r}: layer {key[0]} {key[1]} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise LoRAError(f"{path!r}: layer {key[0]} {key[1]} has rank {a.shape[0]}, the config says {config.rank}")
        weights[key] = (a, b * config.scaling)
    if not weights:
        raise LoRAError(f"{path!r}: the adapter has no LoRA weights")
    return LoRAWeights(config.rank, weights)
