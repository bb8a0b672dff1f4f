"""Random PEFT LoRA adapters for a tiny model, made with ``peft`` itself and saved as PEFT saves them."""

from __future__ import annotations

import copy

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, path, *, rank: int, alpha: float, target_modules, seed: int,
                 use_rslora: bool = False, std: float = 0.15) -> str:
    """A LoRA adapter on a copy of `base_model` with seeded random A and B (B nonzero, so it changes
    the outputs), saved under `path` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(str(path))
    return str(path)


def load_peft_reference(base_model, path):
    """HF + PEFT: `base_model` (copied) with the adapter at `path`, for inference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base_model), str(path)).eval()
