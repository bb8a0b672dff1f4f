"""A smaller draft model cut from a Llama-family checkpoint: its first layers, final norm and head.

Speculative decoding with `"method": "draft_model"` needs a smaller model with the same tokenizer; when
none is at hand (offline, only the default model), the target's first layers make one: the residual
stream after a few layers, read through the final norm and the (tied) head, already predicts the
easy tokens.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from pagedllm.errors import ModelLoadError

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json", "tokenizer.model")


def write_truncated_model(source_dir: str | Path, target_dir: str | Path, num_layers: int) -> Path:
    """Write an HF directory (config.json with num_hidden_layers=`num_layers`, one safetensors file,
    the tokenizer files) holding `source_dir`'s first `num_layers` layers and every non-layer weight."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(source_dir), Path(target_dir)
    config = json.loads((source / "config.json").read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers <= total:
        raise ModelLoadError(f"cannot keep {num_layers} layers of {source} (it has {total})")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {source}")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                match = _LAYER_KEY.match(key)
                if match is None or int(match.group(1)) < num_layers:
                    tensors[key] = f.get_tensor(key).contiguous()
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPIED_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target
