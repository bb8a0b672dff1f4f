"""Incremental detokenization and stop strings against real (in-test trained) tokenizers."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedllm.engine.output_processor import IncrementalDetokenizer, check_stop_strings, find_stop_string
from pagedllm.sampling_params import SamplingParams

CORPUS = [
    "Hello world, héllo wörld! 你好世界 😀🎉 naïve café — ünïcödé. " * 3,
    "The quick brown fox jumps over the lazy dog. 日本語のテキスト 🚀 Ελληνικά κείμενο. " * 3,
    "def main():\n    print('hi')\n\treturn 0  # tabs and  spaces\n",
]
SAMPLE_TEXT = "Hello wörld! 你好世界 😀🎉 The quick brown fox — naïve café 🚀 日本語"


@functools.lru_cache(maxsize=None)
def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE; small vocabulary, so multi-byte characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


@functools.lru_cache(maxsize=None)
def sentencepiece_style_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for spaces, the first one stripped on decode, byte fallback for non-ASCII."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"])
    base.train_from_iterator(["Hello world, hello there! The quick brown fox jumps over the lazy dog. " * 3], trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def smollm2():
    """The embedded default model's tokenizer (the loader converts the model on first use)."""
    from tests.engine.tiny_llama_dir import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)


def _tokenizer(name: str):
    if name == "smollm2":
        return smollm2()
    return {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_style_bpe}[name]()


TOKENIZERS = ["byte_level", "sentencepiece", "smollm2"]


def _stream(tokenizer, ids, chunks, params=None):
    """Feed ids in chunks; return (detokenizer, streamed deltas, matched stop)."""
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    deltas, stop, pos = [], None, 0
    for size in chunks:
        if pos >= len(ids):
            break
        stop = detok.update(ids[pos : pos + size])
        pos += size
        deltas.append(detok.get_next_delta())
        if stop is not None:
            break
    else:
        if pos < len(ids):
            stop = detok.update(ids[pos:])
            deltas.append(detok.get_next_delta())
    if stop is None:
        stop = detok.finish()
    deltas.append(detok.get_next_delta())
    return detok, deltas, stop


@pytest.mark.parametrize("name", TOKENIZERS)
def test_one_token_at_a_time_matches_full_decode(name):
    tokenizer = _tokenizer(name)
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    full = tokenizer.decode(ids, skip_special_tokens=True)
    for i, token_id in enumerate(ids):
        assert detok.update([token_id]) is None
        assert full.startswith(detok.output_text)
        assert "\ufffd" not in detok.output_text
        assert detok.output_text == tokenizer.decode(ids[: i + 1]).rstrip("\ufffd") or (
            tokenizer.decode(ids[: i + 1]).endswith("\ufffd")
        )
    detok.finish()
    assert detok.output_text == full
    assert detok.token_ids == ids


def test_multibyte_characters_really_split_across_tokens():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("😀🎉🚀", add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)


def _random_ids(name, tokenizer, data) -> list[int]:
    if name != "sentencepiece":
        # Byte-level BPE decodes any id sequence self-consistently (lossy UTF-8 over the bytes).
        return data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40), label="ids")
    # Byte fallback turns an invalid byte run into one U+FFFD per byte, even bytes that decoded fine
    # on their own (e.g. <0x00> then <0x80>): text already streamed would change. So draw well-formed
    # runs: ordinary tokens, and characters spelled as their UTF-8 byte tokens.
    byte_ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    ordinary = [i for i in range(len(tokenizer)) if i not in set(byte_ids)]
    segments = data.draw(
        st.lists(st.one_of(st.sampled_from(ordinary).map(lambda i: [i]), st.characters().map(
            lambda c: [byte_ids[b] for b in c.encode("utf-8", "surrogatepass")]
        )), max_size=25),
        label="segments",
    )
    return [i for segment in segments for i in segment]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_ids_random_chunks_match_full_decode(name, data):
    tokenizer = _tokenizer(name)
    ids = _random_ids(name, tokenizer, data)
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=40), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    params = SamplingParams(skip_special_tokens=skip)
    detok, deltas, stop = _stream(tokenizer, ids, chunks, params)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert stop is None
    assert detok.output_text == full
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_natural_text_random_chunks_streams_exactly(name):
    tokenizer = _tokenizer(name)
    ids = tokenizer.encode(SAMPLE_TEXT * 2, add_special_tokens=False)
    for chunks in ([1] * len(ids), [3, 1, 4, 1, 5, 9, 2, 6] * 20, [len(ids)]):
        detok, deltas, _ = _stream(tokenizer, ids, chunks)
        assert detok.output_text == "".join(deltas) == tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_skip_special_tokens(name):
    tokenizer = _tokenizer(name)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello wörld", add_special_tokens=False) + [eos]
    for skip in (True, False):
        detok, deltas, _ = _stream(tokenizer, ids, [1] * len(ids), SamplingParams(skip_special_tokens=skip))
        assert detok.output_text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert (tokenizer.eos_token in detok.output_text) == (not skip)


def _spanning_stop(tokenizer, ids, text):
    """A stop string of 3+ characters that no single token's text contains (it spans tokens)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    for start in range(len(text) - 3):
        for length in (3, 4):
            candidate = text[start : start + length]
            if "\ufffd" not in candidate and not any(candidate in p for p in pieces) and text.count(candidate) == 1:
                return candidate
    raise AssertionError("no spanning stop string found")


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_spanning_tokens(name, include, chunk):
    tokenizer = _tokenizer(name)
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    full = tokenizer.decode(ids)
    stop = _spanning_stop(tokenizer, ids, full)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok, deltas, matched = _stream(tokenizer, ids, [chunk] * len(ids), params)
    assert matched == stop and detok.stop_reason == stop and detok.finished
    cut = full.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == full[:cut]
    # streaming never showed text that was later cut
    assert "".join(deltas) == detok.output_text


def test_earliest_stop_string_wins_and_text_after_is_dropped():
    tokenizer = byte_level_bpe()
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["lazy", "fox", "quick brown fox jumps"])
    # All ids in one update: several stop strings occur; the earliest start wins.
    detok = IncrementalDetokenizer(tokenizer, params)
    assert detok.update(ids) == "quick brown fox jumps"
    assert detok.output_text == "The "
    assert detok.get_next_delta() == "The "


def test_stop_string_in_first_update_with_include():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("Hello world, hello there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["world"], include_stop_str_in_output=True))
    assert detok.update(ids) == "world"
    assert detok.output_text == "Hello world"
    assert detok.token_ids == ids


def test_stop_strings_wait_for_min_tokens():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("ab ab ab ab ab ab", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["ab"], min_tokens=3, max_tokens=16))
    stop = None
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id])
        if stop is not None:
            break
    assert stop == "ab"
    assert len(detok.token_ids) > 3
    text = tokenizer.decode(detok.token_ids)
    assert detok.output_text == text[: text.rindex("ab")]


def test_streaming_holds_back_a_possible_stop_prefix():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["world!!"]))
    detok.update(ids)
    assert detok.output_text == "Hello world"
    assert detok.get_next_delta() == "Hello"  # 6 = len("world!!") - 1 characters held back
    assert detok.get_next_delta() == ""
    assert detok.finish() is None
    assert detok.get_next_delta() == " world"


def test_finish_flushes_an_incomplete_character_like_decode():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    partial = next(n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(ids[:partial])
    assert "\ufffd" not in detok.output_text
    assert detok.finish() is None
    assert detok.output_text == tokenizer.decode(ids[:partial])
    assert detok.finish() is None  # idempotent


def test_find_stop_string_and_check_stop_strings():
    assert find_stop_string("abcabc", ["c", "bc"]) == (1, "bc")
    assert find_stop_string("abcabc", ["bc", "b"]) == (1, "bc")  # same start: first listed
    assert find_stop_string("abcabc", ["x"]) is None
    assert find_stop_string("abcabc", ["a"], start=1) == (3, "a")
    # only matches ending in the new characters count (earlier ones were seen before)
    assert check_stop_strings("xxSTOPyy", 2, ["STOP"], False) is None
    assert check_stop_strings("xxSTOPyy", 3, ["STOP"], False) == ("STOP", 2)
    assert check_stop_strings("xxSTOPyy", 3, ["STOP"], True) == ("STOP", 6)
    assert check_stop_strings("xxSTOPyy", 0, ["STOP"], True) is None
    assert check_stop_strings("xxSTOPyy", 8, [], True) is None


def test_update_decodes_a_bounded_window():
    """Amortized O(new tokens): each decode call sees only a few ids, however long the output."""
    tokenizer = byte_level_bpe()
    seen = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(SAMPLE_TEXT * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(CountingTokenizer(), SamplingParams())
    for token_id in ids:
        detok.update([token_id])
    detok.finish()
    assert detok.output_text == tokenizer.decode(ids)
    assert max(seen) <= 8
    assert sum(seen) <= 6 * len(ids)


def test_ids_after_a_stop_are_ignored():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["world"]))
    assert detok.update(ids) == "world"
    assert detok.update(ids) is None
    assert detok.token_ids == ids and detok.output_text == "Hello "
    assert detok.finish() == "world"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_decodes_through_the_rust_tokenizer_when_equivalent(name):
    from pagedllm.engine.output_processor import _decoder

    tokenizer = _tokenizer(name)
    decode = _decoder(tokenizer, skip_special_tokens=True)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the fast path is taken for plain fast tokenizers
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip in (True, False):
        assert _decoder(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_keeps_the_transformers_decode_when_it_differs():
    """Space clean-up, or a subclass's own decode, must not be bypassed."""
    from pagedllm.engine.output_processor import _decoder

    base = byte_level_bpe()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>",
                                       clean_up_tokenization_spaces=True)
    assert _decoder(cleaning, True).func == cleaning.decode

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    ids = shouting.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(shouting, SamplingParams())
    detok.update(ids)
    detok.finish()
    assert detok.output_text == shouting.decode(ids) == "HELLO WORLD"
