"""Hugging Face transformers as the reference: greedy generations and the near-tie rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE_LOGPROB_GAP = 1e-4
LOGPROB_ATOL = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[torch.Tensor]
    """log_softmax of HF's raw logits at each generated position, [vocab] each."""


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> Reference:
    """HF `generate`, one prompt at a time, greedy; raw logits of every step kept."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos_token_id,
        pad_token_id=_first(eos_token_id) if eos_token_id is not None else 0,
        output_logits=True,
        return_dict_in_generate=True,
        temperature=None, top_p=None, top_k=None,
    )
    token_ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step_logits[0].float(), dim=-1) for step_logits in out.logits]
    return Reference(token_ids, logprobs[: len(token_ids)])


def _first(ids):
    return ids[0] if isinstance(ids, (list, tuple)) else ids


def assert_matches_reference(ours_ids: list[int], ours_logprobs: list[float] | None, ref: Reference, label: str) -> str:
    """Token-for-token equality, with one tolerated exception: a genuine near-tie.

    At the first differing position, both tokens must be in HF's top 5 and their HF logprobs
    differ by less than 1e-4; the comparison stops there. Returns 'exact' or 'near-tie@i'.
    """
    for i, ref_token in enumerate(ref.token_ids):
        assert i < len(ours_ids), f"{label}: ours stopped after {len(ours_ids)} tokens, HF made {len(ref.token_ids)}"
        ours_token = ours_ids[i]
        if ours_token != ref_token:
            logprobs = ref.logprobs[i]
            top5 = torch.topk(logprobs, 5).indices.tolist()
            gap = abs(logprobs[ours_token].item() - logprobs[ref_token].item())
            assert ours_token in top5 and ref_token in top5 and gap < NEAR_TIE_LOGPROB_GAP, (
                f"{label}: first difference at generated token {i}: ours {ours_token}, HF {ref_token} "
                f"(HF logprobs {logprobs[ours_token].item():.6f} vs {logprobs[ref_token].item():.6f}; "
                f"HF top-5 {top5})"
            )
            return f"near-tie@{i}"
        if ours_logprobs is not None:
            expected = ref.logprobs[i][ref_token].item()
            assert abs(ours_logprobs[i] - expected) < LOGPROB_ATOL, (
                f"{label}: logprob of token {i} is {ours_logprobs[i]:.6f}, HF says {expected:.6f}"
            )
    assert len(ours_ids) == len(ref.token_ids), (
        f"{label}: ours made {len(ours_ids)} tokens, HF {len(ref.token_ids)}"
    )
    return "exact"


def engine_greedy(llm, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True,
                  with_logprobs: bool = True):
    """Our engine, all prompts in one batch, greedy: [(token ids, logprob of each chosen token)]
    (logprobs None without ``with_logprobs``: then steps may take the greedy-only LM head)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, logprobs=0 if with_logprobs else None,
                            ignore_eos=ignore_eos)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = None
        if with_logprobs:
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        results.append((completion.token_ids, logprobs))
    return results
