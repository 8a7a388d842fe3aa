"""The CLI: exit codes and one-line errors (no traceback wall)."""

import json
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


@pytest.mark.parametrize("name", ["h100_qwen3_8b.yaml", "a100_qwen32b.yaml"])
def test_validate_gpu_configs_anywhere(capsys, monkeypatch, name):
    """validate checks the config, not this machine's devices: GPU configs pass on a CPU box."""
    monkeypatch.delenv("SPADE_KERNELS", raising=False)
    assert main(["validate", "--config", str(ROOT / "configs" / name)]) == 0, capsys.readouterr().err


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


def test_bad_model_name_is_one_line(tmp_path, capsys):
    r = _main(["run", "--config", str(ROOT / "configs" / "cpu_tiny.yaml"), "--set", "model.name=no-such-model",
               "--out", str(tmp_path / "r.json")], capsys)
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


# ----------------------------------------------------------------------------- fail before work, keep the work
TINY = ["model.name=tiny", "model.max_seq_len=96", "policy.budget=12", "policy.sink_tokens=2", "policy.recent_tokens=3",
        "policy.window=4", "generation.max_new_tokens=6", "generation.stop_at_eos=false",
        "generation.prompts=[{text: 'a b c d e f g h i j k l m n o p'}, {text: 'x y z'}]"]


def _sets(over):
    out = []
    for o in over:
        out += ["--set", o]
    return out


def _cli(args, env_over=None, drop=(), timeout=300):
    import os

    env = {**os.environ, "SPADE_KERNELS": "torch", **(env_over or {})}
    for k in drop:
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "spade.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _main(args, capsys):
    """``spade.cli.main`` in process (what ``python -m spade.cli`` runs), its exit code and
    stderr as a finished process's (an interpreter start is ~10 s on a busy 2-core box)."""
    import types

    capsys.readouterr()
    rc = main(args)
    return types.SimpleNamespace(returncode=rc, stderr=capsys.readouterr().err)


def _one_error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("spade: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_non_utf8_yaml_names_the_file_and_byte(tmp_path, cmd):
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(b"model:\n  name: tiny\n# caf\xe9\n")
    line = _one_error_line(_cli([cmd, "--config", str(cfg), "--out", str(tmp_path / "r.json")][: 3 if cmd == "validate"
                                                                                              else 5]))
    assert str(cfg) in line and "not UTF-8" in line and "byte 0xe9 at offset 25 (line 3, column 6)" in line


@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_lone_surrogate_prompt_names_the_prompt(tmp_path, cmd):
    cfg = tmp_path / "s.yaml"
    cfg.write_text('model: {name: tiny}\ngeneration:\n  prompts:\n    - text: "fine"\n    - text: "a \\ud800 b"\n')
    args = [cmd, "--config", str(cfg)] + (["--out", str(tmp_path / "r.json")] if cmd == "run" else [])
    line = _one_error_line(_cli(args))
    assert "generation.prompts[1].text" in line and "U+D800" in line and "at character 2" in line
    assert not (tmp_path / "r.json").exists()  # refused before any work


def test_non_utf8_override_is_one_line(tmp_path):
    arg = b"generation.prompts=[{text: \"a\xff\"}]".decode("utf-8", "surrogateescape")
    line = _one_error_line(_cli(["validate", "--config", str(ROOT / "configs" / "cpu_tiny.yaml"), "--set", arg]))
    assert "--set generation.prompts" in line and "byte 0xff" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU case")
@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_triton_kernels_on_cpu_is_one_line(tmp_path, cmd):
    args = [cmd, "--config", str(ROOT / "configs" / "cpu_tiny.yaml"), *_sets(TINY)]
    if cmd == "run":
        args += ["--out", str(tmp_path / "r.json")]
    r = _cli(args, {"SPADE_KERNELS": "triton"}, drop=("TRITON_INTERPRET",))
    line = _one_error_line(r)
    assert "SPADE_KERNELS=triton" in line and "CUDA GPU" in line and "TRITON_INTERPRET=1" in line
    assert r.stderr.count("SPADE_KERNELS=triton") == 1 and "cache rank failed" not in r.stderr


@pytest.mark.parametrize("out, why", [("/dev/null/x.json", "/dev/null is not a directory"),
                                      ("{tmp}", "is a directory"),
                                      ("{tmp}/file.txt/sub/r.json", "file.txt is not a directory")])
def test_out_is_checked_before_the_model_loads(tmp_path, capsys, monkeypatch, out, why):
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    (tmp_path / "file.txt").write_text("x")
    out = out.format(tmp=tmp_path)
    r = _main(["run", *_sets(TINY), "--out", out], capsys)
    line = _one_error_line(r)
    assert f"--out {out}" in line and why in line
    assert "loaded tiny" not in r.stderr  # nothing was loaded


def test_run_json_records_backend_device_dtype_and_events(tmp_path):
    out = tmp_path / "new" / "dir" / "r.json"
    r = _cli(["run", "-q", *_sets(TINY), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["status"] == "ok" and "error" not in s
    assert (s["backend"], s["device"], s["dtype"], s["kernels"]) == ("fast", "cpu", "float32", "torch")
    assert s["events"] == [] and s["runtime_stats"]["sparse_steps"] > 0 and s["on_late"] == "wait"
    assert s["generated_tokens"] == [6, 6]


def _in_process_run(tmp_path, capsys, over=()):
    out = tmp_path / "r.json"
    rc = main(["run", "-q", *_sets([*TINY, *over]), "--out", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("spade: error:")]
    return rc, lines, (json.loads(out.read_text()) if out.exists() else None)


def test_dead_cache_rank_is_survived(tmp_path, capsys, monkeypatch):
    """The cache rank dies at step 3 under on_late=wait: the run completes (a new cache
    rank takes over), exits 0, and the JSON records the loss and the restore."""
    import spade.runtime as runtime
    from spade.runtime.asyncrt import AsyncRuntime
    from spade.runtime.protocol import CacheHooks

    monkeypatch.setenv("SPADE_KERNELS", "torch")
    monkeypatch.setattr(runtime, "build_runtime",
                        lambda cfg, be, pol: AsyncRuntime(cfg, be, pol, hooks=CacheHooks(die_at_step=3)))
    rc, lines, s = _in_process_run(tmp_path, capsys, ["runtime.late_timeout_s=5"])
    assert rc == 0 and lines == []
    assert s["status"] == "ok" and s["backend"] == "fast" and s["device"] == "cpu" and s["dtype"] == "float32"
    assert [e["event"] for e in s["events"]][:2] == ["peer_lost", "peer_restored"]
    assert all(r["finished"] != "error" for r in s["results"])


def test_any_failure_leaves_a_partial_json(tmp_path, capsys, monkeypatch):
    """A non-spade exception mid-generation (a bug): one line with its type, partial JSON."""
    from spade.static import StaticEngine

    real = StaticEngine._sampler

    def sampler(self, *a):
        s, n = real(self, *a), [0]

        def sample(logits):
            n[0] += 1
            if n[0] == 3:
                raise KeyError("boom")
            return s(logits)
        return sample

    monkeypatch.setenv("SPADE_KERNELS", "torch")
    monkeypatch.delenv("SPADE_DEBUG", raising=False)
    monkeypatch.setattr(StaticEngine, "_sampler", sampler)
    rc, lines, s = _in_process_run(tmp_path, capsys)
    assert rc == 2 and len(lines) == 1
    assert "the run failed: KeyError: 'boom'" in lines[0] and "[2, 2] token(s) per prompt" in lines[0]
    assert s["status"] == "failed" and s["error"] == {"type": "KeyError", "message": "'boom'"}
    assert s["generated_tokens"] == [2, 2]


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
