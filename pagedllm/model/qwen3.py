"""Qwen3: Llama with an RMSNorm over each head's query and key before rotary, and no q/k/v bias."""

from dataclasses import replace

from pagedllm.model.llama import DecoderSpec, LlamaForCausalLM, llama_spec


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        return replace(llama_spec(config), qk_norm=True)
