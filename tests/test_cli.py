"""The CLI: exit codes and one-line errors (no traceback wall)."""

import subprocess
import sys
from pathlib import Path

import pytest

from spade.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_validate_ok(capsys):
    assert main(["validate", "--config", str(ROOT / "configs" / "cpu_tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "policy" in out and "asyncspade" in out


@pytest.mark.parametrize(
    "override, field",
    [("policy.budgt=3", "policy.budgt"), ("policy.budget=abc", "policy.budget"),
     ("policy.budget=-1", "policy.budget"), ("policy.name=magic", "policy")],
)
def test_validate_rejects(capsys, override, field):
    rc = main(["validate", "--config", str(ROOT / "configs" / "cpu_tiny.yaml"), "--set", override])
    err = capsys.readouterr().err
    assert rc != 0
    assert f"{field}:" in err and "Traceback" not in err


def test_policies_and_transports_list(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in ("full", "oracle", "quest", "tova", "asyncspade", "streaming"):
        assert name in out
    assert main(["transports"]) == 0
    out = capsys.readouterr().out
    assert "local" in out and "usable" in out and "nccl" in out and "ucx" in out and "nixl" in out


def test_bad_model_name_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "spade.cli", "run", "--config", str(ROOT / "configs" / "cpu_tiny.yaml"),
                        "--set", "model.name=no-such-model", "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "unknown model 'no-such-model'" in r.stderr and "smollm2-135m" in r.stderr
    assert "Traceback" not in r.stderr


def test_import_spade_needs_no_optional_packages():
    # ``import spade`` loads no torch; validating a config imports the registered policy
    # and transport modules (their config classes; torch) but no optional transport package
    code = ("import sys, spade; assert 'torch' not in sys.modules, 'import spade loaded torch'; "
            "spade.load_config(None, overrides=['runtime.topology=multiprocess', 'runtime.transport.name=nixl']); "
            "bad = [m for m in ('ucxx', 'nixl', 'nixl_cu13') if m in sys.modules]; "
            "print(bad); assert not bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_bench_outside_a_checkout_is_one_clear_line(tmp_path):
    # an installed package: spade/ without the benchmarks/ folder beside it
    import shutil

    site = tmp_path / "site"
    shutil.copytree(ROOT / "spade", site / "spade", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-m", "spade.cli", "bench", "tpot", "--device", "cpu"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "source checkout" in lines[0] and "Traceback" not in r.stderr


def test_bench_config_only_where_declared(capsys):
    from spade import cli

    assert cli.TAKES_CONFIG <= set(cli.BENCHES)
    assert main(["bench", "kernels", "--config", str(ROOT / "configs" / "cpu_tiny.yaml")]) == 2
    assert "takes no --config" in capsys.readouterr().err
