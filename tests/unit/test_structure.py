"""The import graph of mpiasgd/ stays straight (issue 37; `python dev/structure.py` prints it): no cycles between
files, no import from a lower layer of dev/structure.py's LAYERS to a higher one, and no import inside a function
but those of its LAZY allow list (optional dependencies, mpi4py.MPI whose import runs MPI_Init, slow imports) and
of LAZY_MODULES (the command line's dispatch)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "mpiasgd")


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("dev_structure", os.path.join(ROOT, "dev", "structure.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def arrows(structure):
    return structure.imports(PACKAGE)


def test_no_cycles_between_files(structure, arrows):
    assert structure.cycles(arrows) == []


def test_every_module_is_in_a_layer_and_no_arrow_points_up(structure, arrows):
    for module in structure.package_modules(PACKAGE):
        if module != "mpiasgd":
            structure.layer(module)  # ValueError naming a module that no prefix of LAYERS names
    wrong = [f"{a.source}:{a.line} -> {a.target}" for a in structure.wrong_way(arrows)]
    assert wrong == []


def test_in_function_imports_are_on_the_allow_list(structure, arrows):
    allowed, rest = structure.lazy_imports(arrows)
    assert [f"{a.source}:{a.line} {a.target}" for a in rest] == []
    assert allowed, "the optional dependencies (cupy, tensorboardX, mpi4py.MPI, ...) are imported lazily"
    assert all(reason for _, reason in allowed)


def _package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "mpiasgd"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def test_the_checks_find_what_they_look_for(structure, tmp_path):
    """A cycle, an arrow up the layers, and an import in a function of neither an allowed dependency nor a
    module that brings one in, are found; a lazy `import cupy` and a lazy import of a module that imports
    mpi4py.MPI are allowed, with the reason."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "files.py": "from mpiasgd import cli\n",                                   # foundations -> commands
        "ops/__init__.py": "",
        "ops/a.py": "from mpiasgd.ops import b\n",
        "ops/b.py": "from mpiasgd.ops.a import x\n\n\ndef f():\n    import cupy\n",  # cycle a <-> b; cupy: allowed
        "comms/__init__.py": "",
        "comms/waits.py": "from mpi4py import MPI\n",
        "cli.py": "def f():\n    from mpiasgd.comms import waits\n",                  # allowed: dispatch
        "data/__init__.py": "",
        "data/x.py": "def f():\n    from mpiasgd.comms import waits\n    from mpiasgd.ops import a\n    import json\n",
    })
    arrows = structure.imports(root)
    assert structure.cycles(arrows) == [["mpiasgd.ops.a", "mpiasgd.ops.b"]]
    assert [(a.source, a.target) for a in structure.wrong_way(arrows)] == [("mpiasgd.files", "mpiasgd.cli")]
    allowed, rest = structure.lazy_imports(arrows)
    assert sorted((a.source, a.target) for a in rest) == [("mpiasgd.data.x", "json"),
                                                          ("mpiasgd.data.x", "mpiasgd.ops.a")]
    reasons = {(a.source, a.target): reason for a, reason in allowed}
    assert reasons[("mpiasgd.ops.b", "cupy")] == "cupy"
    assert reasons[("mpiasgd.data.x", "mpiasgd.comms.waits")] == "mpiasgd.comms.waits -> mpi4py.MPI"
    assert reasons[("mpiasgd.cli", "mpiasgd.comms.waits")] == "LAZY_MODULES[mpiasgd.cli]"


def test_a_lazy_import_of_what_the_module_loads_anyway_is_not_allowed(structure, tmp_path):
    """mpi4py.MPI is no reason to import lazily in a module that imports it at module level already."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "comms/__init__.py": "",
        "comms/waits.py": "from mpi4py import MPI\n",
        "comms/wire.py": "from mpi4py import MPI\n\n\ndef f():\n    from mpiasgd.comms import waits\n",
    })
    _, rest = structure.lazy_imports(structure.imports(root))
    assert [(a.source, a.target) for a in rest] == [("mpiasgd.comms.wire", "mpiasgd.comms.waits")]


def test_a_package_whose_init_imports_upward_is_an_arrow_of_its_modules_importers(structure, tmp_path):
    """Importing mpiasgd.launch.ranks runs mpiasgd/launch/__init__.py first: when that imports rank0, a rank0
    module importing launch.ranks closes a cycle (the one rank0/serve.py and launch/ had)."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "launch/__init__.py": "from mpiasgd.rank0 import serve\n",
        "launch/ranks.py": "",
        "rank0/serve.py": "from mpiasgd.launch.ranks import Rank\n",
    })
    arrows = structure.imports(root)
    assert structure.cycles(arrows) == [["mpiasgd.launch", "mpiasgd.rank0.serve"]]
    assert sorted((a.source, a.target) for a in structure.wrong_way(arrows)) == [
        ("mpiasgd.rank0.serve", "mpiasgd.launch"), ("mpiasgd.rank0.serve", "mpiasgd.launch.ranks")]


def test_scripts_take_the_argparse_types_from_argtypes_not_the_command_line():
    """bench/ and dev/ scripts import `positive`, `fraction`, ... from mpiasgd.argtypes: mpiasgd.cli is the top of
    the graph, and importing it would load the command line's own imports."""
    found = []
    for folder in ("bench", "dev"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                with open(os.path.join(ROOT, folder, name), encoding="utf-8") as f:
                    found += [f"{folder}/{name}" for line in f if line.strip().startswith("from mpiasgd.cli import")]
    assert found == []
