"""Shared test fixtures. Tests build tiny models in-process; nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that reached for the hub would hang here: fail fast


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run many small ops: with 2 threads on a busy 2-core machine OpenMP waits dominate
    (measured 150x slower), so modules that use this run single-threaded; results do not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
