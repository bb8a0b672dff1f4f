"""pagedllm: an LLM inference and serving engine built on a paged KV cache."""

import os

# OpenMP threads that spin while waiting turn every op into a fight for the cores as soon as
# anything else runs (the API server, a second engine, the test runner): measured on this
# 2-core machine under load, a decode batch ran 8x slower spinning (1.9 vs 15.8 tok/s).
# libgomp reads this when torch loads, so it must be set before the first `import torch`.
# The compiled CPU ops run on their own workers instead, which spin briefly between the regions
# of a step unless the process is contended (csrc/thread_pool.cpp).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest",
           "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
