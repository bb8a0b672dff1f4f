"""Tiny random sentence-transformers models for the embedding tests: a decoder (or encoder) with the
default model's tokenizer, saved with the Pooling / Dense / Normalize modules asked for."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import torch

from tests.engine.tiny_llama_dir import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""No chat template: sentence-transformers then encodes plain text, as pagedllm does."""


def build_decoder_dir(path: Path, kind: str, seed: int = 0) -> Path:
    """A seeded 2-layer causal LM of `kind` (llama, qwen2, qwen3) with the default tokenizer (vocab 49152)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    config = {"llama": lambda: LlamaConfig(**common), "qwen2": lambda: Qwen2Config(**common),
              "qwen3": lambda: Qwen3Config(head_dim=16, **common)}[kind]()
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    source = default_model_dir()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config))
    return path


def append_eos_in_post_processor(model_dir: Path, eos: str = "<|endoftext|>") -> int:
    """Make the tokenizer append `eos` to every text (as Qwen3-Embedding's does); returns its id."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    eos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == eos)
    sequence = {"Sequence": {"id": "A", "type_id": 0}}
    special = {"SpecialToken": {"id": eos, "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [sequence, special],
        "pair": [sequence, {"Sequence": {"id": "B", "type_id": 1}}, special],
        "special_tokens": {eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}}}
    path.write_text(json.dumps(tokenizer))
    return eos_id


def save_st_model(transformer_dir: Path, out: Path, pooling_mode, dense: tuple[int, str] | None = None,
                  normalize: bool = True, legacy_pooling: bool = False, prompts: dict | None = None,
                  default_prompt_name: str | None = None, seed: int = 1) -> Path:
    """`transformer_dir` saved as a sentence-transformers model: Transformer, Pooling(`pooling_mode`), an
    optional Dense (out_features, 'tanh' or 'identity'), an optional Normalize. `legacy_pooling` rewrites
    1_Pooling/config.json in the full `pooling_mode_*` boolean form."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(seed)
    transformer = Transformer(str(transformer_dir))
    hidden = transformer.get_embedding_dimension()
    pooling = Pooling(hidden, pooling_mode=pooling_mode)
    modules = [transformer, pooling]
    if dense is not None:
        out_features, activation = dense
        modules.append(Dense(pooling.get_embedding_dimension(), out_features,
                             activation_function=torch.nn.Tanh() if activation == "tanh" else torch.nn.Identity()))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(out))
    if legacy_pooling:
        modes = (pooling_mode,) if isinstance(pooling_mode, str) else tuple(pooling_mode)
        legacy = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": "cls" in modes,
                  "pooling_mode_mean_tokens": "mean" in modes, "pooling_mode_max_tokens": "max" in modes,
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens" in modes,
                  "pooling_mode_weightedmean_tokens": "weightedmean" in modes,
                  "pooling_mode_lasttoken": "lasttoken" in modes}
        (out / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    return out


def st_encode(model_dir: Path, texts: list[str], **kwargs):
    """sentence-transformers' own vectors for `texts` (float32 numpy, [len(texts), dim])."""
    return _sentence_transformer(str(model_dir)).encode(texts, convert_to_numpy=True, **kwargs)


@functools.lru_cache(maxsize=4)
def _sentence_transformer(model_dir: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_dir, device="cpu")


def assert_vectors_equal(ours, reference, label: str = "") -> None:
    """Equal within float32 tolerance: cosine > 0.9999 and max abs diff < 1e-4, row by row."""
    import numpy as np

    ours, reference = np.asarray(ours, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    assert ours.shape == reference.shape, f"{label}: shape {ours.shape} vs sentence-transformers' {reference.shape}"
    cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    max_diff = np.abs(ours - reference).max()
    assert cosine.min() > 0.9999 and max_diff < 1e-4, f"{label}: cosine {cosine.min():.6f}, max abs diff {max_diff:.2e}"


WORDS = ("the quick brown fox jumps over lazy dog paged attention keeps cache in fixed size blocks what is capital "
         "of france hello world a query document relevant answer paris berlin city river").split()


def build_encoder_dir(path: Path, kind: str = "bert", seed: int = 0, num_labels: int | None = None) -> Path:
    """A seeded 2-layer BERT or RoBERTa with a small WordPiece vocabulary (its own [CLS]/[SEP]); with
    `num_labels`, the *ForSequenceClassification model (a cross-encoder)."""
    from transformers import (AutoModel, AutoModelForSequenceClassification, BertConfig, BertTokenizerFast,
                              RobertaConfig)

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz?.,",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True).save_pretrained(str(path))
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, hidden_act="gelu")
    if kind == "bert":
        config = BertConfig(type_vocab_size=2, pad_token_id=0, **common)
    else:  # positions from padding_idx + 1, one token type
        # one token type, as RoBERTa's; two for pairs, which this WordPiece tokenizer gives segment ids
        config = RobertaConfig(type_vocab_size=1 if num_labels is None else 2, pad_token_id=0,
                               **{**common, "max_position_embeddings": 130})
    if num_labels is not None:  # large weights: scores far apart, so equality is not a tie of near-0.5s
        config.num_labels, config.initializer_range = num_labels, 0.5
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config) if num_labels is not None \
        else AutoModel.from_config(config)
    model.save_pretrained(path)
    return path
