"""Turning one step's logits into tokens, laid out as vLLM lays out its sampler:

    metadata.py             SamplingRow (one sequence's parameters) -> SamplingMetadata (one step's tensors)
    logits_processors.py    logit_bias, min_tokens, penalties, the structured-output bitmask
    logprobs.py             the logprobs and ranks reported to the user (prompt logprobs too)
    sampler.py              Sampler: composes the above in vLLM's order; greedy rows by argmax (the greedy
                            head's path too); random rows: temperature, top-k, top-p, min-p, one inverse-CDF draw
    rejection_sampler.py    speculative decoding: verifies proposed tokens against the same distribution

Import from the module that defines a name; this file re-exports nothing.
"""
