"""A GGUF embedder pools as its metadata's `<arch>.pooling_type` says (llama.cpp's), normalized as
llama.cpp's embeddings are; the reference is Hugging Face's last hidden states of the same weights."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from tests.engine.st_models import assert_vectors_equal
from tests.model.gguf_writer_helpers import write_converted_gguf
from tests.model.tiny_models import make_hf_model


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@torch.inference_mode()
def hf_pooled(hf_model, prompt: list[int], mode: str) -> torch.Tensor:
    hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()  # after the final norm
    pooled = {"mean": hidden.mean(0), "cls": hidden[0], "lasttoken": hidden[-1]}[mode]
    return F.normalize(pooled, dim=-1)


def test_gguf_pooling_type_mean_cls_last(tmp_path):
    hf_model = make_hf_model("qwen3", seed=3, max_position_embeddings=256)
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    for pooling_type, mode in [(1, "mean"), (2, "cls"), (3, "lasttoken")]:
        path = tmp_path / f"emb-{mode}.gguf"
        write_converted_gguf(hf_model, path, pooling_type=pooling_type)
        llm = LLM(model=str(path), runner="pooling", dtype="float32", max_num_batched_tokens=16)
        reference = torch.stack([hf_pooled(hf_model, p, mode) for p in prompts])
        assert_vectors_equal(llm.embed(prompts), reference.numpy(), f"GGUF pooling_type {pooling_type}")
    path = tmp_path / "rank.gguf"
    write_converted_gguf(hf_model, path, pooling_type=4)
    with pytest.raises(ModelLoadError, match="pooling_type 4"):
        LLM(model=str(path), runner="pooling")
