"""``spade.envs``: the one table of ``SPADE_*`` environment variables and its parser."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spade import envs
from spade.envs import VARS, capture_key, env, env_choice
from spade.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- spade.envs table: begin -->", "<!-- spade.envs table: end -->"


def test_env_parses_every_kind(monkeypatch):
    monkeypatch.delenv("SPADE_SELECT_OVERLAP", raising=False)
    assert env("SPADE_SELECT_OVERLAP") == "auto"  # unset: the default
    monkeypatch.setenv("SPADE_SELECT_OVERLAP", "  ")
    assert env("SPADE_SELECT_OVERLAP") == "auto"  # empty: the default
    monkeypatch.setenv("SPADE_SELECT_OVERLAP", " OFF ")
    assert env("SPADE_SELECT_OVERLAP") == "off"  # stripped, lower-cased
    monkeypatch.setenv("SPADE_FUSE_GLU", "0")
    assert env("SPADE_FUSE_GLU") == "off"  # an alias
    monkeypatch.setenv("SPADE_ATTN_PROGRAMS_PER_SM", "4")
    assert env("SPADE_ATTN_PROGRAMS_PER_SM") == 4
    monkeypatch.delenv("SPADE_HOST_PROFILE", raising=False)
    assert env("SPADE_HOST_PROFILE") is None
    monkeypatch.setenv("SPADE_HOST_PROFILE", "/tmp/Prof.txt")
    assert env("SPADE_HOST_PROFILE") == "/tmp/Prof.txt"  # a path keeps its case


@pytest.mark.parametrize("name, value, words", [
    ("SPADE_SELECT_OVERLAP", "maybe", "must be one of auto, on, off, got 'maybe'"),
    ("SPADE_FUSE_GLU", "2", "must be on or off, got '2'"),
    ("SPADE_PDL", "x", "must be one of auto, all, decode, off, got 'x'"),
    ("SPADE_KERNELS", "cuda", "must be one of auto, triton, torch, got 'cuda'"),
    ("SPADE_CACHE_GRAPHS", "no way", "must be 1 or 0, got 'no way'"),
    ("SPADE_ATTN_PROGRAMS_PER_SM", "0", "must be an integer >= 1, got '0'"),
    ("SPADE_ATTN_PROGRAMS_PER_SM", "three", "must be an integer >= 1, got 'three'"),
])
def test_garbage_names_the_variable_value_and_choices(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name} {words}")):
        env(name)


def test_env_choice_raises_the_callers_error(monkeypatch):
    monkeypatch.setenv("SPADE_FUSE_GLU", "maybe")
    with pytest.raises(ConfigError, match="SPADE_FUSE_GLU must be on or off, got 'maybe'"):
        env_choice("SPADE_FUSE_GLU", error=ConfigError)


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="SPADE_NOT_A_SETTING"):
        env("SPADE_NOT_A_SETTING")


def test_every_entry_is_complete():
    for name, v in VARS.items():
        assert name == v.name and name.startswith("SPADE_") and "__" not in name
        assert v.meaning.strip() and "\n" not in v.meaning
        assert v.kind in ("choice", "int", "text")
        assert (v.choices is not None) == (v.kind == "choice")
        if v.choices is not None:
            assert v.default in v.choices and all(t in v.choices for t in v.aliases.values())


def test_capture_key_follows_the_captured_variables(monkeypatch):
    captured = [v.name for v in VARS.values() if v.capture]
    assert "SPADE_PDL" in captured and "SPADE_SELECT_OVERLAP" in captured
    for n in captured:
        monkeypatch.delenv(n, raising=False)
    base = capture_key()
    monkeypatch.setenv("SPADE_PDL", "off")
    assert capture_key() != base
    monkeypatch.setenv("SPADE_KERNELS", "torch")  # not recorded by graphs
    monkeypatch.setenv("SPADE_PDL", "")
    assert capture_key() == base


def test_importing_envs_loads_nothing_heavy():
    code = ("import sys, spade.envs; "
            "heavy = [m for m in ('torch', 'triton', 'pydantic', 'yaml', 'spade.config', 'spade.eval', "
            "'spade.policies', 'spade.kernels') if m in sys.modules]; print(heavy); assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


_NAME = re.compile(r"\bSPADE_[A-Z0-9_]*[A-Z0-9]\b")
_DIRECT = re.compile(r"(os\.environ|os\.getenv|environ\.get)[^\n]*SPADE_")


def _sources():
    return sorted((ROOT / "spade").rglob("*.py"))


def test_every_spade_variable_in_the_source_is_in_the_table():
    """Any ``SPADE_X`` named in spade/ (a read, or a docstring telling users to set it)
    is a table entry; ``SPADE_<SECTION>__<FIELD>`` config overrides are pydantic-settings'."""
    unknown = {}
    for path in _sources():
        for name in _NAME.findall(path.read_text()):
            if "__" not in name and name not in VARS:
                unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"SPADE_ variables missing from spade.envs.VARS: {unknown}"


def test_no_spade_variable_is_read_around_the_table():
    direct = [f"{p.relative_to(ROOT)}:{i}" for p in _sources() if p.name != "envs.py"
              for i, line in enumerate(p.read_text().splitlines(), 1) if _DIRECT.search(line)]
    assert not direct, f"read SPADE_ variables with spade.envs.env: {direct}"


def test_the_docs_list_is_the_table():
    text = (ROOT / "docs" / "runtime.md").read_text()
    assert BEGIN in text and END in text, "docs/runtime.md lost its generated list"
    listed = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert listed == envs.markdown(), "docs/runtime.md is stale: paste `python -m spade.envs --markdown`"


def test_markdown_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "spade.envs", "--markdown"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout == envs.markdown()
