"""The SLURM tier's packages, installed ahead: when a session selects tests that take the `slurm`
fixture (tests/slurm/test_slurm.py) and `slurm.cluster.PACKAGES` are missing, their apt-get install
starts in a background thread at the end of collection, so that it downloads and unpacks while the
earlier tiers run (docs/testing.md has its time); the `slurm` fixture waits for it, then starts the
cluster as before. MPIASGD_SLURM=0 or --collect-only starts nothing."""

from __future__ import annotations

import os

import pytest

from slurm import cluster


@pytest.hookimpl(trylast=True)  # after -k / -m deselected what the session will not run
def pytest_collection_modifyitems(config, items):
    if (os.environ.get("MPIASGD_SLURM") == "0" or config.option.collectonly
            or not any("slurm" in getattr(i, "fixturenames", ()) for i in items)):
        return
    config.stash[cluster.INSTALL_AHEAD] = cluster.install_ahead()
