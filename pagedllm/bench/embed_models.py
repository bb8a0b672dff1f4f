"""Random-weight sentence-transformers models and texts for `pagedllm bench embed`.

No model hub is needed: each shape is built from its config with seeded random weights and saved the
way sentence-transformers saves a model (Transformer, Pooling, Normalize; a cross-encoder through
CrossEncoder.save). The vocabulary is made of whole words, one token each, so a text of n words is a
known number of tokens and the batch's lengths are exactly the ones asked for.
"""

from __future__ import annotations

import itertools
import random
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    kind: str
    """'bert' (an encoder, WordPiece tokenizer with [CLS]/[SEP]) or 'qwen3' (a decoder, EOS appended)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    head_dim: int | None = None


SHAPES = {
    # all-MiniLM-L6-v2's shape
    "minilm": Shape("bert", num_layers=6, hidden_size=384, num_heads=12, intermediate_size=1536, vocab_size=30522),
    # Qwen3-Embedding-0.6B's shape, with a smaller vocabulary (the embedding table is looked up, not multiplied)
    "qwen3-0.6b": Shape("qwen3", num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=3072,
                        vocab_size=30522, num_kv_heads=8, head_dim=128),
    # for smoke runs
    "bert-tiny": Shape("bert", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=2000),
    "qwen3-tiny": Shape("qwen3", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=2000,
                        num_kv_heads=2, head_dim=16),
}
POOLING = {"bert": "mean", "qwen3": "lasttoken"}
"""all-MiniLM-L6-v2 pools by the mean, Qwen3-Embedding by the last token; both then normalize."""
MAX_LEN = 512
SPECIAL_TOKENS = {"bert": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), "qwen3": ("<pad>", "<unk>", "<eos>")}
NUM_SPECIAL_PER_TEXT = {"bert": 2, "qwen3": 1}
"""Tokens the tokenizer adds to one text: [CLS] and [SEP]; the EOS Qwen3-Embedding's tokenizer appends."""


def words(vocab_size: int, num_special: int) -> list[str]:
    """Distinct lowercase words (syllable pairs, then triples) filling the vocabulary after the specials."""
    syllables = [c + v for c in "bcdfghjklmnprstvwxyz" for v in "aeiou"]
    pool = itertools.chain(("".join(p) for p in itertools.product(syllables, repeat=2)),
                           ("".join(p) for p in itertools.product(syllables, repeat=3)))
    return list(itertools.islice(pool, vocab_size - num_special))


def texts_of_lengths(shape: Shape, lengths: list[int], seed: int) -> list[str]:
    """One text per length, each exactly that many tokens once the tokenizer adds its special tokens."""
    vocab = words(shape.vocab_size, len(SPECIAL_TOKENS[shape.kind]))
    rng = random.Random(seed)
    extra = NUM_SPECIAL_PER_TEXT[shape.kind]
    return [" ".join(rng.choice(vocab) for _ in range(max(1, n - extra))) for n in lengths]


def mixed_lengths(num: int, low: int, high: int, seed: int) -> list[int]:
    """`num` token counts drawn uniformly from [low, high]."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num)]


def _save_tokenizer(shape: Shape, path: Path) -> None:
    specials = SPECIAL_TOKENS[shape.kind]
    vocab = [*specials, *words(shape.vocab_size, len(specials))]
    path.mkdir(parents=True, exist_ok=True)
    if shape.kind == "bert":
        from transformers import BertTokenizerFast

        (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
        BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True, model_max_length=MAX_LEN).save_pretrained(path)
        return
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos_id = vocab.index("<eos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <eos>", pair="$A <eos> $B:1 <eos>:1", special_tokens=[("<eos>", eos_id)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                            model_max_length=MAX_LEN,
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(path)


def _config(shape: Shape, num_labels: int | None = None):
    from transformers import BertConfig, Qwen3Config

    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, intermediate_size=shape.intermediate_size)
    if shape.kind == "bert":
        config = BertConfig(max_position_embeddings=MAX_LEN, type_vocab_size=2, pad_token_id=0, hidden_act="gelu",
                            **common)
    else:
        config = Qwen3Config(num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                             max_position_embeddings=MAX_LEN, pad_token_id=0, eos_token_id=2,
                             tie_word_embeddings=True, **common)
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def _save_transformer(shape: Shape, path: Path, seed: int, num_labels: int | None = None) -> Path:
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = _config(shape, num_labels)
    model = AutoModelForSequenceClassification.from_config(config) if num_labels is not None \
        else AutoModel.from_config(config)
    if num_labels is not None:
        # a large head spreads the scores (compared between the two systems) away from sigmoid's 0.5; large
        # weights everywhere would saturate attention, where float rounding alone then flips scores
        torch.nn.init.normal_(model.classifier.weight, std=0.5)
    model.save_pretrained(path)
    _save_tokenizer(shape, path)
    return path


def build_embedder(shape_name: str, root: Path, seed: int = 0) -> Path:
    """A random sentence-transformers embedder of `shape_name` under `root`: Transformer, Pooling, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    shape = SHAPES[shape_name]
    hf = _save_transformer(shape, root / f"{shape_name}-hf", seed)
    transformer = Transformer(str(hf), max_seq_length=MAX_LEN)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=POOLING[shape.kind])
    out = root / f"{shape_name}-st"
    SentenceTransformer(modules=[transformer, pooling, Normalize()]).save(str(out))
    shutil.rmtree(hf)  # the sentence-transformers directory holds its own copy of the weights
    return out


def build_cross_encoder(shape_name: str, root: Path, seed: int = 0) -> Path:
    """A random one-label cross-encoder (BertForSequenceClassification) of an encoder shape, saved by CrossEncoder."""
    from sentence_transformers.cross_encoder import CrossEncoder

    shape = SHAPES[shape_name]
    if shape.kind != "bert":
        raise ValueError(f"--rerank-shape must be an encoder shape, got {shape_name!r} ({shape.kind})")
    hf = _save_transformer(shape, root / f"{shape_name}-cross-hf", seed, num_labels=1)
    out = root / f"{shape_name}-cross"
    CrossEncoder(str(hf)).save(str(out))
    shutil.rmtree(hf)
    return out
