"""``spade.envs.env_choice``: the one parser of the environment's launch settings."""

from __future__ import annotations

import pytest

from spade.envs import env_choice
from spade.errors import ConfigError


def test_env_choice(monkeypatch):
    monkeypatch.delenv("SPADE_TEST_CHOICE", raising=False)
    assert env_choice("SPADE_TEST_CHOICE", ("a", "b", "c"), "b") == "b"  # unset: the default
    monkeypatch.setenv("SPADE_TEST_CHOICE", "  ")
    assert env_choice("SPADE_TEST_CHOICE", ("a", "b", "c"), "b") == "b"  # empty: the default
    monkeypatch.setenv("SPADE_TEST_CHOICE", " C ")
    assert env_choice("SPADE_TEST_CHOICE", ("a", "b", "c"), "b") == "c"  # stripped, lower-cased
    monkeypatch.setenv("SPADE_TEST_CHOICE", "1")
    assert env_choice("SPADE_TEST_CHOICE", ("on", "off"), "off", aliases={"1": "on"}) == "on"
    monkeypatch.setenv("SPADE_TEST_CHOICE", "x")
    with pytest.raises(ValueError, match=r"SPADE_TEST_CHOICE must be one of a, b, c, got 'x'"):
        env_choice("SPADE_TEST_CHOICE", ("a", "b", "c"), "b")
    with pytest.raises(ConfigError, match=r"SPADE_TEST_CHOICE must be on or off, got 'x'"):
        env_choice("SPADE_TEST_CHOICE", ("on", "off"), "on", error=ConfigError)
