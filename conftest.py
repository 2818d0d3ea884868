"""Suite-wide settings for the two-worker run (pyproject addopts: ``-n 2 --dist loadfile``).

Loaded before any test module imports torch, so the thread count reaches torch in the workers and in
every process they launch."""

from __future__ import annotations

import os

import pytest

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    # Two workers with two OpenMP threads each on two cores spin against each other: the real-base tests
    # and the study smoke ran 2x slower beside another worker than alone. One core per worker.
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test go first: workers take files in this order, and a long file taken
    last runs alone at the end while the other worker idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file stays
