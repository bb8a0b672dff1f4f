"""The former home of ``pagedllm.structured.grammar``: its names, for code written against this path before the
move (the layering test refuses this path from entrypoints/). To be removed once nothing imports it."""

from pagedllm.structured.grammar import GrammarCache, InvalidGrammarError, StructuredOutputManager, build_grammar

__all__ = ["GrammarCache", "InvalidGrammarError", "StructuredOutputManager", "build_grammar"]
