"""A transformers config's attributes, saved once beside a converted GGUF and read back without transformers.

Importing any of transformers' model config classes imports its activation registry, which imports
``torch.distributed.tensor`` and sympy: about 55 MB of a serving engine core's memory that a 1 B Q4_0 model (578 MB
of weights) cannot spare. The first load of a converted GGUF reads its config.json with transformers; ``save``
writes every public attribute the config class resolved (defaults, derived values such as ``head_dim``, aliases
from ``attribute_map``, properties), and later loads of that directory build a ``ResolvedConfig`` from them. The model code only reads attributes, so both are the same to it.

The saved file names the transformers version and the config.json it was made from: after an upgrade or an edit
the directory's config is read with transformers again, and the file is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

FILE_NAME = "pagedllm_resolved_config.json"


class ResolvedConfig:
    """Attribute access to a saved config's values (nested dicts, such as ``rope_parameters``, stay dicts)."""

    def __init__(self, attributes: dict, hf_dir: Path) -> None:
        self.__dict__.update(attributes)
        self._hf_dir = hf_dir

    def to_dict(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_hf_dir"}

    def to_transformers(self):
        """The transformers config itself (importing its class), for code that calls its methods: transformers'
        rotary initializers for scaled RoPE (linear, llama3, longrope, ...)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(self._hf_dir))

    def __repr__(self) -> str:
        return f"ResolvedConfig(model_type={getattr(self, 'model_type', None)!r}, {len(self.__dict__)} attributes)"


def resolved_attributes(config) -> dict:
    """Every public, non-callable attribute of a transformers ``config`` whose value is plain JSON data."""
    from transformers.utils import logging as transformers_logging

    attributes = {}
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # deprecated properties warn when read
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in dir(config):
                if name.startswith("_"):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # a property that does not apply to this config
                    continue
                if not callable(value) and _is_plain(value):
                    attributes[name] = value
    finally:
        transformers_logging.set_verbosity(verbosity)
    return attributes


def save(config, hf_dir: Path) -> None:
    """Write ``config``'s resolved attributes into ``hf_dir`` (atomically: readers see the old file or the new)."""
    payload = {"transformers_version": version("transformers"), "config_sha256": _config_digest(hf_dir),
               "attributes": resolved_attributes(config)}
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=hf_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, hf_dir / FILE_NAME)


def load(hf_dir: Path) -> ResolvedConfig | None:
    """The config saved in ``hf_dir``; None if there is none, or it was made by another transformers version."""
    try:
        payload = json.loads((hf_dir / FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if payload.get("transformers_version") != version("transformers") or payload.get("config_sha256") != _config_digest(
            hf_dir):
        return None
    return ResolvedConfig(payload["attributes"], hf_dir)


def _config_digest(hf_dir: Path) -> str | None:
    try:
        return hashlib.sha256((hf_dir / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None


def _is_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
