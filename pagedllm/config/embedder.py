"""A sentence-transformers model directory read exactly: what its vector is made of.

No torch here: the front end reads the prompts and limits from it, the runner builds its pooler
(model/layers/pooler.py) from it.

    modules.json                      the pipeline, in order: Transformer, Pooling, Dense*, Normalize
    sentence_bert_config.json         the Transformer's max_seq_length and do_lower_case
    1_Pooling/config.json             the full form (`pooling_mode_*_tokens` booleans, concatenated in
                                      sentence-transformers' legacy order) or the compact `pooling_mode`
                                      (one name, or a list concatenated in its order)
    2_Dense/config.json (+ weights)   in_features, out_features, bias, activation_function
    config_sentence_transformers.json prompts, default_prompt_name, similarity_fn_name

A directory without modules.json is pooled by `default_pooling`: last token + Normalize for a
decoder (what decoder embedders such as Qwen3-Embedding are trained with), mean for an encoder
(what sentence-transformers itself builds around a bare transformers model).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.errors import ModelLoadError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
"""sentence-transformers' names; the full form's booleans map to them in this order (its concatenation order)."""
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODE_ALIASES = {"mean_sqrt_len": "mean_sqrt_len_tokens", "last": "lasttoken", "last_token": "lasttoken"}
ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}
"""Dense activation_function (a class path) -> the name the pooler applies."""


@dataclass(frozen=True, slots=True)
class DenseLayer:
    """One `*_Dense` module: y = activation(x @ W.T + b)."""

    path: str
    """Its directory (absolute), holding model.safetensors or pytorch_model.bin with linear.weight/.bias."""
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """A value of ACTIVATIONS."""


@dataclass(frozen=True, slots=True)
class EmbedderConfig:
    """How a model's hidden states become its sentence embedding, and what its front end applies."""

    pooling_modes: tuple[str, ...]
    """Names from POOLING_MODES; several are concatenated in this order."""
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = False
    """A Normalize module ends the pipeline: unit L2 norm."""
    max_seq_length: int | None = None
    """sentence-transformers truncates longer inputs to this; we refuse them unless truncation is asked."""
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Output sizes a request may ask for (config.json `matryoshka_dimensions`; `is_matryoshka`: any);
    None: the model is no Matryoshka model and `dimensions` is refused."""
    from_sentence_transformers: bool = False
    """False: no modules.json, `default_pooling` applied."""
    hidden_size: int | None = None
    """The transformer's (config.json), when it says."""
    score_activation: str | None = None
    """Set for a cross-encoder (a *ForSequenceClassification model): it scores text pairs, its one logit
    through this activation (a value of ACTIVATIONS: sentence-transformers' activation_fn, by default
    sigmoid); None: an embedder."""
    generates: bool = False
    """The engine also generates text (runner 'both'); False: it pools only."""

    @property
    def embedding_size(self) -> int | None:
        """Values in the model's vector: the last Dense's out_features, else the pooled hidden states'."""
        if self.dense:
            return self.dense[-1].out_features
        return None if self.hidden_size is None else self.hidden_size * len(self.pooling_modes)

    @property
    def needs_every_position(self) -> bool:
        """Whether pooling reads more than the last position (then prefix-cache hits cannot stand in)."""
        return self.pooling_modes != ("lasttoken",)

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError naming why `dimensions` cannot be served by this model."""
        if dimensions is None:
            return
        full_size = self.embedding_size or dimensions
        if self.matryoshka_dimensions is None:
            raise ValueError("this model does not support `dimensions` (it declares no Matryoshka "
                             "representation: config.json has no matryoshka_dimensions)")
        allowed = self.matryoshka_dimensions or range(1, full_size + 1)
        if dimensions not in allowed:
            shown = list(self.matryoshka_dimensions) if self.matryoshka_dimensions else f"1..{full_size}"
            raise ValueError(f"dimensions {dimensions} is not one this model supports: {shown}")


def default_pooling(is_decoder: bool) -> EmbedderConfig:
    """The pooling of a directory without sentence-transformers files (module docstring)."""
    return EmbedderConfig(("lasttoken",), normalize=True) if is_decoder else EmbedderConfig(("mean",))


ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
"""config.json model_types read as bidirectional encoders (model/bert.py)."""


def embedder_for(runner: str, model_path: str, model: str | None = None) -> EmbedderConfig | None:
    """The pooling an engine of `runner` applies: the model's (runner 'pooling' or 'both'), else None.
    `model_path`: the Hugging Face directory loaded; `model`: what the user named, whose GGUF metadata, if it
    is a GGUF file, says the pooling when no sentence-transformers files do (llama.cpp's pooling_type;
    normalized, as llama.cpp's embeddings are by default)."""
    if runner not in ("pooling", "both"):
        return None
    config = read_embedder_config(model_path)
    mode = None if config.from_sentence_transformers else gguf_pooling(model)
    if mode is not None:
        config = EmbedderConfig((mode,), normalize=True, matryoshka_dimensions=config.matryoshka_dimensions,
                                hidden_size=config.hidden_size)
    return dataclasses.replace(config, generates=runner == "both")


GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}
"""llama.cpp's `<arch>.pooling_type` values we pool by (0 is none, 4 is rank: refused)."""


def gguf_pooling(model: str | None) -> str | None:
    """The pooling mode a GGUF file's metadata names; None when `model` is no GGUF file or names none."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
        arch = fields["general.architecture"].contents()
        field = fields.get(f"{arch}.pooling_type")
        value = None if field is None else int(field.contents())
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated or bad files
        raise ModelLoadError(f"cannot read the GGUF metadata of {str(path)!r}: {e}") from e
    if value is None:
        return None
    if value not in GGUF_POOLING_TYPES:
        raise ModelLoadError(f"{path}: GGUF pooling_type {value} ({ {0: 'none', 4: 'rank'}.get(value, '?') }) is not "
                             f"supported; mean (1), cls (2) and last (3) are")
    return GGUF_POOLING_TYPES[value]


def read_embedder_config(model_dir: str | Path, is_decoder: bool | None = None) -> EmbedderConfig:
    """The EmbedderConfig of `model_dir`; ModelLoadError naming the file or module it cannot follow.
    `is_decoder` None: from config.json's model_type (ENCODER_MODEL_TYPES are encoders)."""
    root = Path(model_dir)
    raw_config = _read_json(root / "config.json") if (root / "config.json").exists() else {}
    if is_decoder is None:
        is_decoder = raw_config.get("model_type") not in ENCODER_MODEL_TYPES
    if any(str(a).endswith("ForSequenceClassification") for a in raw_config.get("architectures") or ()):
        return _cross_encoder_config(root, raw_config)
    matryoshka = _matryoshka_dimensions(raw_config)
    if not (root / "modules.json").exists():
        base = default_pooling(is_decoder)
        return EmbedderConfig(base.pooling_modes, normalize=base.normalize, matryoshka_dimensions=matryoshka,
                              hidden_size=raw_config.get("hidden_size"))
    modules = _read_json(root / "modules.json")
    pooling_modes: tuple[str, ...] | None = None
    dense: list[DenseLayer] = []
    normalize = False
    transformer: dict = {}
    for index, module in enumerate(modules):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = root / module.get("path", "")
        if normalize:
            raise ModelLoadError(f"{root / 'modules.json'}: module {kind} after Normalize is not supported")
        if kind == "Transformer":
            if index != 0:
                raise ModelLoadError(f"{root / 'modules.json'}: the Transformer must be the first module")
            if (path / "sentence_bert_config.json").exists():
                transformer = _read_json(path / "sentence_bert_config.json")
            if "message" in (transformer.get("modality_config") or {}):
                raise ModelLoadError(f"{path / 'sentence_bert_config.json'}: inputs rendered through the chat "
                                     f"template (sentence-transformers' 'message' modality) are not supported; "
                                     f"only the plain 'text' modality is")
        elif kind == "Pooling":
            pooling_modes = _read_pooling(path / "config.json")
        elif kind == "Dense":
            if pooling_modes is None:
                raise ModelLoadError(f"{root / 'modules.json'}: a Dense module before Pooling is not supported")
            dense.append(_read_dense(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{root / 'modules.json'}: sentence-transformers module {module.get('type')!r} "
                                 f"is not supported (Transformer, Pooling, Dense and Normalize are)")
    if pooling_modes is None:
        raise ModelLoadError(f"{root / 'modules.json'} has no Pooling module")
    st = _read_json(root / "config_sentence_transformers.json") \
        if (root / "config_sentence_transformers.json").exists() else {}
    prompts = st.get("prompts") or {}
    default_prompt_name = st.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ModelLoadError(f"default_prompt_name {default_prompt_name!r} is not among the prompts "
                             f"{sorted(prompts)} of {root / 'config_sentence_transformers.json'}")
    return EmbedderConfig(pooling_modes, tuple(dense), normalize, transformer.get("max_seq_length"),
                          bool(transformer.get("do_lower_case", False)), dict(prompts), default_prompt_name,
                          st.get("similarity_fn_name"), matryoshka, from_sentence_transformers=True,
                          hidden_size=raw_config.get("hidden_size"))


def _cross_encoder_config(root: Path, raw_config: dict) -> EmbedderConfig:
    """A cross-encoder: one label, its logit through sentence-transformers' activation_fn (read from
    config_sentence_transformers.json, or config.json's `sentence_transformers`; sigmoid by default)."""
    num_labels = len(raw_config.get("id2label") or {}) or raw_config.get("num_labels", 1)
    if num_labels != 1:
        raise ModelLoadError(f"{root / 'config.json'}: a cross-encoder with {num_labels} labels is not supported "
                             f"(one label, a relevance score, is)")
    st = _read_json(root / "config_sentence_transformers.json") \
        if (root / "config_sentence_transformers.json").exists() else {}
    activation = st.get("activation_fn") or (raw_config.get("sentence_transformers") or {}).get("activation_fn") \
        or "torch.nn.modules.activation.Sigmoid"
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"{root}: cross-encoder activation_fn {activation!r} is not supported; "
                             f"known: {sorted(ACTIVATIONS)}")
    return EmbedderConfig(("cls",), hidden_size=raw_config.get("hidden_size"), score_activation=ACTIVATIONS[activation],
                          from_sentence_transformers=bool(st))


def _read_pooling(config_path: Path) -> tuple[str, ...]:
    config = _read_json(config_path)
    if config.get("include_prompt", True) is not True:
        raise ModelLoadError(f"{config_path}: include_prompt false (pooling without the prompt's tokens) "
                             f"is not supported")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key, False)) or ("mean",)
    modes = tuple(_MODE_ALIASES.get(m, m) for m in modes)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise ModelLoadError(f"{config_path}: unknown pooling mode(s) {unknown or modes}; known: {POOLING_MODES}")
    return modes


def _read_dense(path: Path) -> DenseLayer:
    config = _read_json(path / "config.json")
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"{path / 'config.json'}: activation_function {activation!r} is not supported; "
                             f"known: {sorted(ACTIVATIONS)}")
    try:
        return DenseLayer(str(path), int(config["in_features"]), int(config["out_features"]),
                          bool(config.get("bias", True)), ACTIVATIONS[activation])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'} needs integer in_features and out_features: {e}") from e


def _matryoshka_dimensions(config: dict) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
