"""What the server's front end reads from the model before it serves, without importing torch.

The front end (FastAPI, tokenization, detokenization) needs only the tokenizer; torch and the model belong to the
engine core. Two things used to pull torch into it:

* transformers' ``AutoTokenizer`` imports its configuration classes, which import torch (transformers 5:
  ``configuration_utils`` -> ``modeling_rope_utils``). `load_tokenizer` asks for the class the directory's
  tokenizer_config.json names instead (the class AutoTokenizer would pick), whose module imports no torch.
* A GGUF's first conversion and its config resolved with transformers (``worker.executor.prepare_model_files``) run
  in a short-lived spawned child (`prepare_model_files_in_child`): the engine core then loads without transformers'
  config classes, and the front end keeps neither those nor torch. The child costs a second or two of start-up.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pagedllm.config import EngineArgs

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str):
    """The tokenizer of a Hugging Face directory, or None when it has none."""
    tokenizer_cls = _named_tokenizer_class(Path(model_path))
    if tokenizer_cls is None:  # no class named: AutoTokenizer decides (and imports torch)
        from transformers import AutoTokenizer

        tokenizer_cls = AutoTokenizer
    try:
        return tokenizer_cls.from_pretrained(model_path)
    except (OSError, ValueError):
        logger.warning("no tokenizer in %s: only token-id prompts can be served", model_path)
        return None


def _named_tokenizer_class(model_dir: Path):
    """The tokenizer class tokenizer_config.json names, when transformers has it (AutoTokenizer's first choice too);
    None otherwise."""
    try:
        name = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.endswith(("Tokenizer", "TokenizerFast", "TokenizersBackend")):
        return None
    import transformers

    try:  # transformers 5 folds the *Fast classes into one; older names stay as aliases
        return getattr(transformers, name, None) or getattr(transformers, name.removesuffix("Fast"), None)
    except (ImportError, AttributeError):  # a lazy module that needs a package not installed
        return None


def prepare_model_files_in_child(engine_args: EngineArgs, log_level: str = "INFO") -> Path:
    """``worker.executor.prepare_model_files`` run in a spawned child (torch and transformers' config classes are
    imported there, not here); its errors are raised here."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_prepare_model_files, engine_args, log_level).result()


def _prepare_model_files(engine_args: EngineArgs, log_level: str) -> Path:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from pagedllm.worker.executor import prepare_model_files

    return prepare_model_files(engine_args)
