"""Tool-call parsers by model family (`--tool-call-parser`), vLLM's names."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import CallDelta, Parsed, ParsedDelta, ToolCall, ToolParser, assemble
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.tail_formats import (
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

__all__ = ["TOOL_PARSERS", "CallDelta", "Parsed", "ParsedDelta", "ToolCall", "ToolParser", "assemble"]
