"""Full-model logits against transformers on the same weights: one pass, chunks, token by token."""

import pytest
import torch

from pagedllm.model import load_model
from pagedllm.model.llama import LlamaForCausalLM
from tests.model.paged_kv_helpers import PagedRunner
from tests.model.tiny_models import make_hf_model, save_hf_model

KINDS = ["llama", "llama_tied_scaled", "qwen2", "mistral"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(path)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_loaded_model(pair):
    hf, loaded = pair
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.tokenizer is None and loaded.chat_template is None
    assert loaded.hf_config.model_type == hf.config.model_type


def test_one_pass_no_cache_matches_hf(pair):
    hf, loaded = pair
    ids = prompt(0, 21)
    with torch.no_grad():  # no forward context: attends over the current tokens only
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(21)))
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[21], [8, 5, 8], [1] * 21, [16, 1, 1, 3]])
def test_paged_chunks_match_hf(pair, chunks):
    hf, loaded = pair
    ids = prompt(1, sum(chunks))
    runner = PagedRunner(loaded.model, block_size=4)
    outs, start = [], 0
    for n in chunks:
        outs.append(runner.step([(0, ids[start : start + n])]))
        start += n
    torch.testing.assert_close(torch.cat(outs), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mixed_batch_matches_hf(pair):
    """Prefill chunks of one sequence batched with decodes and prefills of others."""
    hf, loaded = pair
    a, b, c = prompt(2, 19), prompt(3, 12), prompt(4, 5)
    runner = PagedRunner(loaded.model, block_size=4, seed=7)
    plan = [
        [(0, a[:8]), (1, b[:5])],
        [(1, b[5:6]), (0, a[8:13]), (2, c)],
        [(0, a[13:]), (2, []), (1, b[6:12])],
    ]
    got = {0: [], 1: [], 2: []}
    for step in plan:
        step = [(s, toks) for s, toks in step if toks]
        logits = runner.step(step)
        offset = 0
        for seq_id, toks in step:
            got[seq_id].append(logits[offset : offset + len(toks)])
            offset += len(toks)
    for seq_id, ids in ((0, a), (1, b), (2, c)):
        torch.testing.assert_close(torch.cat(got[seq_id]), hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_greedy_decode_matches_hf(pair):
    hf, loaded = pair
    ids = prompt(5, 9)
    runner = PagedRunner(loaded.model, block_size=4)
    logits = runner.step([(0, ids)])
    ours = []
    for _ in range(12):
        token = int(logits[-1].argmax())
        ours.append(token)
        logits = runner.step([(0, [token])])
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert ours == ref
