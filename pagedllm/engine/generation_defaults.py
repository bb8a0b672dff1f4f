"""The sampling defaults a model ships in its ``generation_config.json``, for requests that omit them.

Model authors tune temperature, top-p and friends for their model (Qwen3 ships 0.6 / 0.95 / 20);
a request that leaves a field unset gets the model's value, one that sets it keeps its own, as in
vLLM's ``--generation-config auto``. Only the fields below are taken: the rest of a generation
config (max_new_tokens, eos ids, do_sample) is either the engine's to decide or known elsewhere.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation-config keys that become request defaults (SamplingParams field names)."""


def read_generation_defaults(model_path: str | Path | None) -> dict[str, float | int]:
    """The sampling fields set in ``<model_path>/generation_config.json``; {} when there is none.

    A value of the wrong type (or NaN) is skipped with a warning rather than failing every request."""
    if model_path is None:
        return {}
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    defaults: dict[str, float | int] = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            logger.warning("ignoring %s in %s: %r is not a number", name, path, value)
            continue
        defaults[name] = int(value) if name == "top_k" else float(value)
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
