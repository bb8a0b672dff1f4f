"""`bench all --report` writes only its own page: a hand-written file at that path is never replaced."""

from __future__ import annotations

import time

import pytest

from pagedllm.bench.report import GENERATED_MARKER, NotAGeneratedReport, write_report
from pagedllm.entrypoints.cli import main

HAND_WRITTEN = "# Benchmarks\n\nThe method, and what we learned.\n"


def test_a_new_page_starts_with_the_marker_and_is_replaced_on_the_next_run(tmp_path):
    page = tmp_path / "bench" / "results.md"
    write_report({}, tmp_path / "bench", page, "pagedllm bench all")
    first = page.read_text()
    assert first.splitlines()[0] == GENERATED_MARKER
    assert "`pagedllm bench all`" in first
    write_report({}, tmp_path / "bench", page, "pagedllm bench all --smoke")
    assert "`pagedllm bench all --smoke`" in page.read_text()


@pytest.mark.parametrize("text", [HAND_WRITTEN, f"\n{GENERATED_MARKER}\n", ""])
def test_a_page_it_did_not_write_is_refused_and_left_alone(tmp_path, text):
    page = tmp_path / "benchmarks.md"
    page.write_text(text)
    with pytest.raises(NotAGeneratedReport, match=r"benchmarks\.md exists and was not generated"):
        write_report({}, tmp_path, page, "pagedllm bench all")
    assert page.read_text() == text


def test_bench_all_refuses_before_measuring(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text(HAND_WRITTEN)
    start = time.monotonic()
    code = main(["--log-level", "WARNING", "bench", "all", "--smoke", "--no-progress", "--out", str(tmp_path / "out"),
                 "--report", str(page)])
    assert code == 2
    assert time.monotonic() - start < 30  # no benchmark ran
    assert "refusing to overwrite" in capsys.readouterr().err
    assert page.read_text() == HAND_WRITTEN
    assert not (tmp_path / "out" / "summary.json").exists()
