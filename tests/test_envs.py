"""pagedllm.envs: every PAGEDLLM_* variable declared once, parsed one way, read when asked for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import envs

REPO = Path(__file__).resolve().parent.parent
SWITCHES = [name for name in envs.VARIABLES if name.startswith("PAGEDLLM_DISABLE_") and name != "PAGEDLLM_DISABLE_OP_POOL"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_the_code_reads_is_declared_here_and_read_nowhere_else():
    named = set()
    for path in [*(REPO / "pagedllm").rglob("*.py"), *(REPO / "csrc").glob("*.cpp")]:
        text = path.read_text()
        named |= set(re.findall(r"PAGEDLLM_[A-Z0-9_]+", text))
        if path.name != "envs.py":
            # os.environ.get / os.getenv / environ[...] of a PAGEDLLM_ name, literally or via a *_ENV constant
            reads = re.findall(r"(?:environ\.get|getenv|environ\[)\(?\s*(\"PAGEDLLM_\w+\"|[A-Z_]*_ENV\b)", text)
            assert path.suffix == ".cpp" or reads == [], f"{path.relative_to(REPO)} reads {reads} itself"
    assert named == set(envs.VARIABLES)
    assert len(envs.VARIABLES) == 16
    for name, variable in envs.VARIABLES.items():
        assert variable.doc and "\n" not in variable.doc, name
    # The four the C++ reads are exactly the ones csrc/ names.
    in_csrc = {n for p in (REPO / "csrc").glob("*.cpp") for n in re.findall(r"PAGEDLLM_[A-Z0-9_]+", p.read_text())}
    assert in_csrc == set(envs.COMPILED_OP_VARIABLES)


@pytest.mark.parametrize("name", SWITCHES)
def test_switches(monkeypatch, name):
    assert getattr(envs, name) is False  # unset
    for text, value in [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False),
                        ("No", False), ("off", False), ("", False)]:
        monkeypatch.setenv(name, text)
        assert getattr(envs, name) is value, text
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=rf"^{name}='maybe': expected one of 1, true"):
        getattr(envs, name)


def test_read_when_asked_for_not_at_import(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "1")
    assert envs.PAGEDLLM_DISABLE_HUGE_PAGES is True
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "0")
    assert envs.PAGEDLLM_DISABLE_HUGE_PAGES is False


def test_integers_and_choices(monkeypatch):
    assert envs.PAGEDLLM_POOL_SPIN_US == 50
    monkeypatch.setenv("PAGEDLLM_POOL_SPIN_US", "300")
    assert envs.PAGEDLLM_POOL_SPIN_US == 300
    for bad in ("fast", "1.5", "-1", "10001"):
        monkeypatch.setenv("PAGEDLLM_POOL_SPIN_US", bad)
        with pytest.raises(ValueError, match=rf"PAGEDLLM_POOL_SPIN_US='{re.escape(bad)}': expected an integer in \[0, 10000\]"):
            envs.PAGEDLLM_POOL_SPIN_US
    assert envs.PAGEDLLM_CPU_GEMM_ISA == "best"
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", "AVX2")
    assert envs.PAGEDLLM_CPU_GEMM_ISA == "avx2"
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM_ISA", "sse4")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_GEMM_ISA='sse4': expected one of best, avx512, avx2"):
        envs.PAGEDLLM_CPU_GEMM_ISA


def test_paths_and_strings(monkeypatch, tmp_path):
    assert envs.PAGEDLLM_CACHE == Path.home() / ".cache" / "pagedllm"
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    assert envs.PAGEDLLM_CACHE == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_CACHE", "~/models")
    assert envs.PAGEDLLM_CACHE == tmp_path / "models"
    assert envs.PAGEDLLM_API_KEY is None and envs.PAGEDLLM_DISTRIBUTED_SECRET is None
    monkeypatch.setenv("PAGEDLLM_DISTRIBUTED_SECRET", "  spaces are part of it ")
    assert envs.PAGEDLLM_DISTRIBUTED_SECRET == "  spaces are part of it "  # a secret is never trimmed
    monkeypatch.setenv("PAGEDLLM_API_KEY", "")
    assert envs.PAGEDLLM_API_KEY is None  # empty = unset


def test_the_compiled_library_variables_are_refused_when_the_cpp_would_misread_them(monkeypatch):
    envs.check_compiled_op_env()  # all unset: fine
    monkeypatch.setenv("PAGEDLLM_ATTN_PF", "1,2,3")
    monkeypatch.setenv("PAGEDLLM_DISABLE_OP_POOL", "1")
    envs.check_compiled_op_env()
    assert envs.PAGEDLLM_ATTN_PF == (1, 2, 3) and envs.PAGEDLLM_DISABLE_OP_POOL is True
    monkeypatch.setenv("PAGEDLLM_DISABLE_OP_POOL", "false")  # the C++ takes any value but 0 as "disable"
    with pytest.raises(ValueError, match="PAGEDLLM_DISABLE_OP_POOL='false': expected 0 or 1"):
        envs.check_compiled_op_env()
    monkeypatch.setenv("PAGEDLLM_DISABLE_OP_POOL", "0")
    for bad in ("1,2,3,4", "near"):
        monkeypatch.setenv("PAGEDLLM_ATTN_PF", bad)
        with pytest.raises(ValueError, match=rf"PAGEDLLM_ATTN_PF='{bad}': expected dist\[,mode\[,hint\]\]"):
            envs.check_compiled_op_env()


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="PAGEDLLM_DISABLE_EVERYTHING"):
        envs.PAGEDLLM_DISABLE_EVERYTHING


def test_the_modules_ask_envs(monkeypatch, tmp_path):
    from pagedllm.model import huge_pages, loader
    from pagedllm.model.attention import cpu_op

    unset = huge_pages.available()
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "true")
    assert huge_pages.available() is False
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "false")  # read as "set" before envs parsed switches
    assert huge_pages.available() == unset
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    assert loader.cache_root() == tmp_path
    monkeypatch.setenv("PAGEDLLM_POOL_SPIN_US", "soon")
    monkeypatch.setattr(cpu_op, "_state", {})
    with pytest.raises(ValueError, match="PAGEDLLM_POOL_SPIN_US='soon'"):
        cpu_op.load()  # refused before the library (which would read it as 0) starts
