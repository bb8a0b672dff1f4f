"""A GGUF file's tokenizer as a transformers tokenizer saved beside the converted config: transformers' own
GGUF converter for the vocabularies it reads (SentencePiece, BPE), and for llama.cpp's WordPiece (`bert`)
vocabularies transformers' BERT tokenizer over the pieces as the original vocabulary spelled them."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from pagedllm.errors import ModelLoadError


def convert_tokenizer(gguf_path: Path, field: Callable[..., Any], out_dir: Path) -> None:
    """The tokenizer of ``gguf_path`` (with its chat template) saved into ``out_dir``; ``field(key, default)`` reads
    the file's metadata."""
    from transformers import AutoTokenizer

    if field("tokenizer.ggml.model") == "bert":  # transformers reads no WordPiece GGUF vocabulary
        _wordpiece_tokenizer(gguf_path, field).save_pretrained(str(out_dir))
        return

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF {str(gguf_path)!r}: {e}") from e
    template = field("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def _wordpiece_tokenizer(gguf_path: Path, field: Callable[..., Any]):
    """transformers' BERT tokenizer over the vocabulary llama.cpp's converter stored for a WordPiece model.

    The converter writes each word-initial piece with a leading U+2581 and each continuation (``##x``)
    without its ``##``; control tokens ([CLS], [SEP], ...) as they are. Lower-casing and accent stripping
    follow ``tokenizer.ggml.normalizer.*`` where the file has them (newer converters write them); a file
    without them is lower-cased when no piece of its vocabulary has an upper-case letter (an uncased
    vocabulary, such as bge's or MiniLM's, where a cased text would meet [UNK] on every capital)."""
    from gguf import TokenType
    from transformers import BertTokenizerFast

    fields = GGUFReader(gguf_path).fields  # (validated by the caller; its weights reader skips these arrays)
    pieces = [str(p) for p in fields["tokenizer.ggml.tokens"].contents()]
    types_field = fields.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types_field.contents()] if types_field is not None else [TokenType.NORMAL] * len(pieces)
    broken = next((i for i, piece in enumerate(pieces) if "\n" in piece or "\r" in piece), None)
    if broken is not None:  # a WordPiece vocabulary is one piece a line: this one would shift every id after it
        raise ModelLoadError(f"GGUF {str(gguf_path)!r}: WordPiece token {broken} ({pieces[broken]!r}) contains a "
                             "line break, which no WordPiece vocabulary can hold")
    vocab = []
    for piece, kind in zip(pieces, types):
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
            vocab.append(piece)
        else:
            vocab.append(piece[1:] if piece.startswith("\u2581") else "##" + piece)
    lowercase = field("tokenizer.ggml.normalizer.lowercase")
    if lowercase is None:
        lowercase = not any(ch.isupper() for word, kind in zip(vocab, types) if kind == TokenType.NORMAL
                            for ch in word)
    strip_accents = field("tokenizer.ggml.normalizer.strip_accents", bool(lowercase))

    def special(*names: str) -> str | None:
        for name in names:
            token_id = field(f"tokenizer.ggml.{name}_token_id")
            if token_id is not None and 0 <= int(token_id) < len(vocab):
                return vocab[int(token_id)]
        return None

    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = Path(tmp) / "vocab.txt"
        vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
        try:
            return BertTokenizerFast(
                str(vocab_file), do_lower_case=bool(lowercase), strip_accents=bool(strip_accents),
                unk_token=special("unknown") or "[UNK]", cls_token=special("cls", "bos") or "[CLS]",
                sep_token=special("seperator", "separator", "eos") or "[SEP]",
                pad_token=special("padding") or "[PAD]", mask_token=special("mask") or "[MASK]")
        except Exception as e:
            raise ModelLoadError(f"cannot build a WordPiece tokenizer from GGUF {str(gguf_path)!r}: {e}") from e
