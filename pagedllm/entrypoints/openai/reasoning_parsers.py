"""Reasoning parsers (`--reasoning-parser`): the model's `<think>...</think>` apart from its answer.

    qwen3        reasoning only when the output opens with <think>; otherwise it is all answer
    deepseek_r1  the chat template opened <think> already: everything up to </think> is reasoning
                 (an opening <think> in the output is skipped); no </think> means no answer yet

Incremental as the tool parsers are (tool_parsers/base.py): a possible start of a tag is held until
it can be told apart, so nothing emitted is taken back, and `parse` is the same machine at once.
Whitespace that opens the answer is dropped. The answer then goes to the tool parser, if any.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import held_prefix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser:
    starts_in_reasoning = False
    """Whether the output is reasoning before any tag (the template opened it)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> reasoning -> answer, or start -> answer

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that is certain after this piece."""
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(final=True)

    def parse(self, text: str) -> tuple[str, str]:
        r1, a1 = self.feed(text)
        r2, a2 = self.finish()
        return r1 + r2, a1 + a2

    def _scan(self, final: bool) -> tuple[str, str]:
        reasoning = answer = ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buf, self._state = stripped[len(THINK_OPEN):], "reasoning"
            elif not final and THINK_OPEN.startswith(stripped):
                return "", ""  # only whitespace or part of <think> so far
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "answer_start"
        if self._state == "reasoning":
            i = self._buf.find(THINK_CLOSE)
            if i < 0:
                keep = 0 if final else held_prefix_len(self._buf, THINK_CLOSE)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf, self._state = self._buf[:i], self._buf[i + len(THINK_CLOSE):], "answer_start"
        if self._state == "answer_start":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "answer"
        answer, self._buf = self._buf, ""
        return reasoning, answer


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                        "deepseek_r1": DeepSeekR1ReasoningParser}
