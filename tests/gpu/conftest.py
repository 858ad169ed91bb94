"""GPU checks (`tests/gpu/`, marked `gpu`): skipped with a reason when no CUDA device is visible.

Run them on a machine with a GPU (bench/gpu_check.sh does, with a timing table):

    .venv/bin/pytest -q -rs tests/gpu

`tests/gpu` is a package (as every tier folder is) so that this conftest does not take the module
name `conftest` from tests/conftest.py.
"""

from __future__ import annotations

import pytest

from mpiasgd.ops import cuda_device_count


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and cupy (tests/gpu); skipped without one")


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device visible (or cupy missing): GPU checks need one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
