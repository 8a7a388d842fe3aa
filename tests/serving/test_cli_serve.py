"""``spade serve`` at the command line, before any server runs: the missing extra, the
light ``import spade``, an engine that refuses the config."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spade.cli import main


def test_missing_extra_names_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    assert main(["serve", "--set", "model.name=tiny"]) == 2
    err = capsys.readouterr().err
    assert "spade serve needs the package 'uvicorn'" in err and ".[serve]" in err


def test_import_spade_needs_no_server_packages():
    code = ("import sys, spade, spade.cli, spade.config, spade.serving, spade.serving.openai_protocol, "
            "spade.serving.metrics; spade.load_config(None); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_refusal_is_one_line(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    # an AsyncEngine refuses what it cannot serve (channels re-chosen for every row at once) before loading anything
    rc = main(["serve", "--port", "0", "--set", "model.name=tiny", "--set", "model.device=cpu",
               "--set", "runtime.topology=local", "--set", "policy.score_channels=16"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "policy.score_channels" in err and "Traceback" not in err


def test_port_in_use_is_one_line(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["serve", "--port", str(port), "--set", "model.name=tiny", "--set", "model.device=cpu",
                   "--set", "runtime.topology=inline"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"could not listen on 127.0.0.1:{port}" in err and "serve.port" in err
