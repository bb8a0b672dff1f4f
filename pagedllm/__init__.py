"""pagedllm: an LLM inference and serving engine built on a paged KV cache."""

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
