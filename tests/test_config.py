"""Config loading, precedence and field-level errors."""

from pathlib import Path

import pytest

from spade.config import load_config
from spade.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"cpu_tiny.yaml", "h100_qwen3_8b.yaml", "h200x2_qwen3_8b.yaml", "a100_qwen32b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates(path):
    cfg = load_config(path)
    assert cfg.model.name
    from spade.models.registry import resolve_source

    resolve_source(cfg.model.name)  # the model name must be known


def test_a100_config_is_two_ranks_over_nccl():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "a100_qwen32b.yaml")
    assert cfg.model.name == "qwen3-32b"
    assert cfg.runtime.topology == "multiprocess"
    assert cfg.runtime.transport.name == "nccl"
    assert (cfg.runtime.inference_device, cfg.runtime.cache_device) == ("cuda:0", "cuda:1")


def test_precedence_cli_over_env_over_yaml(tmp_path, monkeypatch):
    y = tmp_path / "c.yaml"
    y.write_text("policy: {name: quest, budget: 64}\nmodel: {max_seq_len: 100}\n")
    assert load_config(y).policy.budget == 64
    monkeypatch.setenv("SPADE_POLICY__BUDGET", "96")
    monkeypatch.setenv("SPADE_MODEL__MAX_SEQ_LEN", "300")
    cfg = load_config(y)
    assert (cfg.policy.name, cfg.policy.budget, cfg.model.max_seq_len) == ("quest", 96, 300)
    cfg = load_config(y, overrides=["policy.budget=128"])
    assert (cfg.policy.name, cfg.policy.budget, cfg.model.max_seq_len) == ("quest", 128, 300)


def test_switch_policy_from_cli_keeps_other_sections(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("policy: {name: asyncspade, budget: 64, predictor: last}\n")
    cfg = load_config(y, overrides=["policy.predictor=ridge", "runtime.topology=multiprocess",
                                    "runtime.transport.name=nccl"])
    assert cfg.policy.predictor == "ridge" and cfg.runtime.transport.name == "nccl"
    assert cfg.runtime.transport.backend == "auto"


@pytest.mark.parametrize(
    "yaml_text, field, words",
    [
        ("policy: {name: asyncspade, budgt: 3}\n", "policy.budgt", ["unknown key", "budget"]),
        ("policy: {name: quest, budget: -5}\n", "policy.budget", ["greater than 0", "-5"]),
        ("policy: {name: nope}\n", "policy", ["unknown policy", "asyncspade", "quest"]),
        ("model: {max_seq_len: lots}\n", "model.max_seq_len", ["integer", "lots"]),
        ("modle: {name: x}\n", "modle", ["unknown key", "model"]),
        ("runtime: {transport: {name: ucx, prot: 1}}\n", "runtime.transport.prot", ["port"]),
        ("runtime: {topology: cluster}\n", "runtime.topology", ["inline", "colocated"]),
        ("policy: {name: asyncspade, budget: 8, sink_tokens: 4, recent_tokens: 16}\n", "policy", ["exceed"]),
    ],
)
def test_errors_name_the_field(tmp_path, yaml_text, field, words):
    y = tmp_path / "bad.yaml"
    y.write_text(yaml_text)
    with pytest.raises(ConfigError) as ei:
        load_config(y)
    msg = str(ei.value)
    assert f"  {field}:" in msg, msg
    for w in words:
        assert w in msg, msg


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, overrides=["policy.budget"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    y = tmp_path / "list.yaml"
    y.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(y)


def test_switching_policy_drops_fields_the_new_one_lacks(tmp_path, monkeypatch):
    y = tmp_path / "c.yaml"
    y.write_text("policy: {name: asyncspade, budget: 64, predictor: last, window: 8}\n"
                 "runtime: {topology: multiprocess, transport: {name: nccl, master_port: 1234}}\n")
    cfg = load_config(y, overrides=["policy.name=full"])
    assert cfg.policy.name == "full"
    cfg = load_config(y, overrides=["policy.name=quest"])
    assert (cfg.policy.name, cfg.policy.budget) == ("quest", 64)  # shared field kept
    monkeypatch.setenv("SPADE_RUNTIME__TOPOLOGY", "colocated")
    monkeypatch.setenv("SPADE_RUNTIME__TRANSPORT__NAME", "local")
    assert load_config(y).runtime.transport.name == "local"
    # a field given explicitly for the new policy that it lacks is still an error
    with pytest.raises(ConfigError, match="policy.window"):
        load_config(y, overrides=["policy.name=full", "policy.window=3"])


@pytest.mark.parametrize("topology", ["inline", "colocated", "local"])
@pytest.mark.parametrize("transport", ["nccl", "ucx", "nixl"])
def test_transport_the_topology_cannot_use_is_an_error(topology, transport, capsys):
    over = [f"runtime.topology={topology}", f"runtime.transport.name={transport}"]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides=over)
    msg = str(e.value)
    assert "runtime.transport.name" in msg and "runtime.topology" in msg
    assert repr(transport) in msg and repr(topology) in msg
    assert "set runtime.transport.name to local" in msg and "runtime.topology to multiprocess" in msg
    from spade.cli import main

    y = Path(__file__).resolve().parent.parent / "configs" / "cpu_tiny.yaml"
    assert main(["validate", "--config", str(y), *[a for o in over for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert "runtime.transport.name" in err and "runtime.topology" in err and "Traceback" not in err
    assert load_config(None, overrides=["runtime.topology=multiprocess", f"runtime.transport.name={transport}"])


def test_pack_layers_auto_is_four_packs_and_a_number_stays_a_number():
    from spade.runtime.protocol import packs_of, resolve_pack_layers

    assert load_config(None).runtime.pack_layers == "auto"
    assert [resolve_pack_layers("auto", n) for n in (1, 3, 4, 5, 30, 36, 64)] == [1, 1, 1, 2, 8, 9, 16]
    assert len(packs_of(36, resolve_pack_layers("auto", 36))) == 4
    assert len(packs_of(3, resolve_pack_layers("auto", 3))) == 3  # fewer layers than packs: one layer each
    cfg = load_config(None, overrides=["runtime.pack_layers=6"])
    assert cfg.runtime.pack_layers == 6 and resolve_pack_layers(cfg.runtime.pack_layers, 36) == 6
    with pytest.raises(ConfigError, match="pack_layers"):
        load_config(None, overrides=["runtime.pack_layers=0"])
    with pytest.raises(ConfigError, match="pack_layers"):
        load_config(None, overrides=["runtime.pack_layers=many"])
