"""The examples in the refill and cache modules' docstrings are run, so they cannot drift from the code."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["acre_train.modeling.scorer_spec", "acre_train.modeling.scoring", "acre_train.modeling.span_choice",
           "acre_train.modeling.bilayer", "acre_train.modeling.kv_buffer", "acre_train.infer.settings",
           "acre_train.eval.calibrate", "acre_train.eval.methods.acre"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
