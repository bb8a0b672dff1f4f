"""Structured outputs: grammars built from a request's `StructuredOutputsParams` and compiled with xgrammar
(grammar.py). Below the API, the engine and the worker alike: the front ends build a grammar to refuse a bad
one before queueing it, the worker compiles it and masks the logits. Importing this package loads nothing
(xgrammar and torch wait for grammar.py)."""
