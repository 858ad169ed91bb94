"""The kernels tier's builds, compiled ahead: at the first test of this folder, every harness build the
selected tests will ask for starts compiling in the background, one g++ per core at a time, in test
order; a test whose build is still compiling waits for it (kernels_cpu.cuda_cpu.harness: one compile
per output), so the cores work while earlier tests run.

A test declares its builds with `@pytest.mark.builds(fn)`, `fn` taking the test's parameters by name
(none for an unparametrized test) and returning [(tsan, {macro: value}), ...]; a test that takes the
`lib` fixture needs the plain build of every kernels/*.cu and its conv tile variants (`LIB_BUILDS`).
Cache entries unused for `kit.cache.PRUNE_DAYS` days are removed at the same moment.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from kit import cache

from kernels_cpu.cuda_cpu import harness
from mpiasgd.ops.cuda.tiles import CONV_TILES, tile_macros

HERE = Path(__file__).resolve().parent
# what a test taking `lib` loads: the plain build and its variant for each conv tile the CUDA backend launches
# (cases.HarnessKernels builds them at the first conv launch; queued here right behind the plain build)
LIB_BUILDS = [(False, {}), *((False, tile_macros(t)) for t in CONV_TILES)]


def pytest_configure(config):
    config.addinivalue_line("markers", "builds(fn): the harness builds a kernels_cpu test needs, compiled ahead")


def selected_builds(items) -> list[tuple[bool, dict[str, int]]]:
    """The (tsan, defines) builds that `items` of this folder need, in item order, each once."""
    specs: dict[tuple, tuple[bool, dict[str, int]]] = {}
    for item in items:
        if HERE not in Path(str(item.path)).parents:
            continue
        wanted = LIB_BUILDS if "lib" in getattr(item, "fixturenames", ()) else []
        params = getattr(getattr(item, "callspec", None), "params", {})
        for marker in item.iter_markers("builds"):
            fn = marker.args[0]
            names = inspect.signature(fn).parameters
            wanted += fn(**{name: params[name] for name in names})
        for tsan, defines in wanted:
            specs.setdefault((tsan, tuple(sorted(defines.items()))), (tsan, dict(defines)))
    return list(specs.values())


@pytest.fixture(scope="session", autouse=True)
def prebuilt(request):
    """Starts the selected tests' builds in the background for the session (nothing without g++)."""
    if harness.find_cxx() is None:
        yield None
        return
    for folder in (harness.CACHE / "obj", harness.CACHE / "lib", cache.cache_dir("compilers")):
        cache.prune(folder)
    pool = harness.prebuild(selected_builds(request.session.items))
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)
