"""The examples in the policy modules' docstrings run (torch kernels)."""

import doctest
import importlib

import pytest

MODULES = ["oracle", "streaming", "quest", "tova", "asyncspade", "predictors", "common"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f"spade.policies.{name}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0
