"""BERT-family GGUF embedders (llama.cpp's `bert` architecture) against sentence-transformers on the same
weights: the file read as transformers' BertModel, its WordPiece vocabulary back as transformers' BERT
tokenizer, its pooling_type as llama.cpp's, normalized."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from tests.engine.st_models import assert_vectors_equal, build_encoder_dir, save_st_model, st_encode
from tests.model.gguf_writer_helpers import write_bert_gguf

CONVERTED = Path(__file__).parent / "data" / "bert-tiny-mean-f16.gguf"
"""Written by llama.cpp's own converter (convert_hf_to_gguf.py, `--outtype f16`) from the model
`build_encoder_dir(seed=0)` saved with mean pooling and Normalize, as `st_model` below builds it."""

TEXTS = ["The quick brown fox", "What is the capital of France?", "Paris", "hello world, a query about a river city",
         "dog", "Paged attention keeps the cache in fixed size blocks. " * 3, "Zebra!"]


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    """The tiny BERT, its 2-D weights made float16-exact so that F16 files hold them unchanged."""
    path = build_encoder_dir(tmp_path_factory.mktemp("bert") / "encoder")
    weights = load_file(str(path / "model.safetensors"))
    save_file({name: t.half().float() if t.dim() == 2 else t for name, t in weights.items()},
              str(path / "model.safetensors"))
    return path


def st_model(encoder_dir: Path, out: Path, mode: str) -> Path:
    return save_st_model(encoder_dir, out, mode)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.F16])
@pytest.mark.parametrize("mode, pooling_type", [("mean", 1), ("cls", 2)])
def test_bert_gguf_embeds_as_sentence_transformers(encoder_dir, tmp_path, qtype, mode, pooling_type):
    model = st_model(encoder_dir, tmp_path / "st", mode)
    path = tmp_path / "bert.gguf"
    write_bert_gguf(model, path, qtype, pooling_type=pooling_type)
    llm = LLM(model=str(path), runner="pooling", dtype="float32", max_num_batched_tokens=32)
    assert_vectors_equal(llm.embed(TEXTS), st_encode(model, TEXTS), f"{qtype.name} {mode}")


def test_the_vocabulary_comes_back_as_the_original_tokenizer(encoder_dir, tmp_path):
    from transformers import AutoTokenizer

    model = st_model(encoder_dir, tmp_path / "st", "mean")
    reference = AutoTokenizer.from_pretrained(str(model))
    texts = TEXTS + ["Crème brûlée, São Paulo", "UNSEEN words xyzzy", "a\tb\nc  d", "?.,", ""]
    for lowercase in (True, None):  # None: no normalizer key (older converters); the vocabulary is uncased
        path = tmp_path / f"bert-{lowercase}.gguf"
        write_bert_gguf(model, path, lowercase=lowercase)
        tokenizer = LLM(model=str(path), runner="pooling").get_tokenizer()
        for text in texts:
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], (lowercase, text)


def test_a_file_written_by_llama_cpps_converter(tmp_path):
    model = st_model(build_encoder_dir(tmp_path / "encoder"), tmp_path / "st", "mean")  # the weights it was made from
    llm = LLM(model=str(CONVERTED), runner="pooling", dtype="float32")
    ours, reference = np.asarray(llm.embed(TEXTS)), st_encode(model, TEXTS)
    cosine = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    # its 2-D weights are float16, the reference's float32: only that rounding apart
    assert cosine.min() > 0.99999 and np.abs(ours - reference).max() < 2e-4, (cosine.min(), np.abs(ours - reference).max())


def test_a_bert_file_missing_a_layer_tensor_is_refused_naming_it(encoder_dir, tmp_path):
    model = st_model(encoder_dir, tmp_path / "st", "mean")
    path = tmp_path / "broken.gguf"
    write_bert_gguf(model, path, drop=("blk.1.layer_output_norm.weight",))
    with pytest.raises(ModelLoadError, match="layer 1.*layer_output_norm"):
        LLM(model=str(path), runner="pooling")


def test_a_vocabulary_piece_with_a_line_break_is_refused(encoder_dir, tmp_path, monkeypatch):
    """vocab.txt holds one piece a line: a piece with a line break would shift every later id."""
    import gguf

    model = st_model(encoder_dir, tmp_path / "st", "mean")
    add_token_list = gguf.GGUFWriter.add_token_list
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list",
                        lambda self, tokens: add_token_list(self, [tokens[0], "\u2581two\nlines", *tokens[2:]]))
    path = tmp_path / "newline.gguf"
    write_bert_gguf(model, path)
    with pytest.raises(ModelLoadError, match="token 1 .*line break"):
        LLM(model=str(path), runner="pooling")


def test_quantized_bert_weights_load(encoder_dir, tmp_path):
    """Q8_0 weights (llama-quantize's common choice for embedders), dequantized at load: the reference is
    sentence-transformers on the same weights rounded through Q8_0."""
    import shutil

    from gguf.quants import dequantize, quantize

    model = st_model(encoder_dir, tmp_path / "st", "mean")
    path = tmp_path / "q8.gguf"
    write_bert_gguf(model, path, GGMLQuantizationType.Q8_0)
    rounded_dir = tmp_path / "rounded"
    shutil.copytree(encoder_dir, rounded_dir)
    q8 = GGMLQuantizationType.Q8_0
    tables = ("embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight")
    weights = {name: torch.from_numpy(dequantize(quantize(t.numpy(), q8), q8).copy())
               if t.dim() == 2 and name not in tables else t
               for name, t in load_file(str(encoder_dir / "model.safetensors")).items()}
    save_file(weights, str(rounded_dir / "model.safetensors"))
    reference = st_encode(st_model(rounded_dir, tmp_path / "st-rounded", "mean"), TEXTS)
    vectors = LLM(model=str(path), runner="pooling", dtype="float32").embed(TEXTS)
    assert_vectors_equal(vectors, reference, "Q8_0")
