#!/usr/bin/env python3
"""Structure figures of the mpiasgd package, for the notes of a refactor (issues 17 and 37): the largest class
and function (lines), the branches on the training mode outside `mpiasgd/modes/` and the config, and the
import graph: the cycles between files, the wrong-way arrows (an import from a lower layer of `LAYERS` to a
higher one) and the imports made inside functions.

    python dev/structure.py [PACKAGE_DIR]        # default: mpiasgd/ next to this file's parent
    python dev/structure.py -v                   # ... and every allowed in-function import, with its reason

A mode branch is a comparison of a value named `mode` (`cfg.mode`, `mode`) with a mode's name or a list
of them (`cfg.mode == "sync"`, `mode not in PS_MODES`; not Pillow's `im.mode == "P"`); the registry of
modes (`modes/`) and the config, which checks each mode's keys, are where such knowledge belongs and are
not counted.

The import graph holds every `import` of a module of the package, at module level and inside functions
(`from mpiasgd.ops import cpu_kernels` is an arrow to `mpiasgd.ops` and to `mpiasgd.ops.cpu_kernels`;
`import mpiasgd.a.b` also to the package `mpiasgd.a` when its `__init__` imports modules of the package: it
runs first); an import of a module's own parent package is left out (Python runs the parent first anyway).
An import inside a function (or class body) is lazy: it is allowed only for a dependency of `LAZY` that
the module does not import at module level already, imported itself or through a module of the package
that imports it at module level, or in a module of `LAZY_MODULES`; it is printed with that reason.
`tests/unit/test_structure.py` keeps the cycles, the wrong-way arrows and the other lazy imports at zero.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

# The layers of the package, lowest first: a module may import its own layer and those below, never above.
# A module belongs to the layer of the longest prefix that names it (a prefix is a module or a package).
LAYERS: list[tuple[str, list[str], str]] = [
    ("foundations", ["mpiasgd.argtypes", "mpiasgd.signals", "mpiasgd.files"],
     "argparse types, signal handling, where a run's files are and full-disk errors: no other mpiasgd module"),
    ("compute", ["mpiasgd.ops", "mpiasgd.comms", "mpiasgd.optim", "mpiasgd.data", "mpiasgd.model", "mpiasgd.device",
                 "mpiasgd.health"],
     "kernels, the wire, update rules, datasets, networks, devices, loss checks: one step's parts, knowing no run"),
    ("records", ["mpiasgd.runlog", "mpiasgd.checkpoint"],
     "what a run writes and its readers read back: run logs (start-up records among them), checkpoints"),
    ("config", ["mpiasgd.config", "mpiasgd.modes.registry"],
     "one run's typed config, and the table of modes and their options it checks (no mode's code)"),
    ("roles", ["mpiasgd.modes", "mpiasgd.rank0"],
     "what each rank does in each training mode: rank 0's loop and recorder, the workers, the shards"),
    ("launchers", ["mpiasgd.launch", "mpiasgd.sim"],
     "start a run and give each rank its role: over MPI (`train`), or every role in one process (`simulate`)"),
    ("commands", ["mpiasgd.tools", "mpiasgd.cli", "mpiasgd.__main__"],
     "offline tools and the command line: nothing imports them"),
]

# Dependencies imported inside functions on purpose, and why (import times on 2 cores).
LAZY: dict[str, str] = {
    "mpi4py.MPI": "its import runs MPI_Init: report, watch, simulate, data and --help must run without MPI",
    "cupy": "optional (extra 'gpu'), absent on CPU machines; its import looks for CUDA",
    "cupy_backends": "part of cupy (optional, extra 'gpu')",
    "torch": "optional (extra 'bench'), the PyTorch references only",
    "tensorboardX": "optional (extra 'tensorboard'), only for --tensorboard",
    "sklearn": "1.2 s to import, only the digits loader needs it",
    "numba": "0.3 s to import and seconds to compile, only the numba kernels need it",
    "matplotlib": "0.6 s to import, only `mpiasgd report --plots` draws",
    "h5py": "0.2 s to import: `mpiasgd --help` and a command's argument errors do not pay for it",
}

# Modules whose in-function imports of the package are all allowed, and why.
LAZY_MODULES: dict[str, str] = {
    "mpiasgd.cli": "dispatch: each subcommand's code is imported when it runs, so `mpiasgd --help` (0.03 s) and "
                   "`report` load nothing of `train`",
    "mpiasgd.tools.data_cli": "its parser is part of `mpiasgd --help`: the converters (numpy, PIL, tqdm) load when "
                              "`mpiasgd data` runs",
}


@dataclass(frozen=True)
class Import:
    """One import statement's arrow: `source` (a module of the package) imports `target` (a module of
    the package, or an outside dependency's dotted name), at `line`, at module level or not (`lazy`)."""

    source: str
    target: str
    line: int
    lazy: bool
    internal: bool


def package_modules(root: str) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under `root` (a package's directory)."""
    parent = os.path.dirname(os.path.abspath(root))
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                parts = os.path.relpath(path, parent)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = path
    return out


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the nodes that run when the module is imported: top-level statements and those inside a
    top-level `if` or `try` (TYPE_CHECKING, fallbacks), not function or class bodies."""
    ids: set[int] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        ids.add(id(node))
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                todo += handler.body
    return ids


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict) -> list[tuple]:
    """(name, internal) of what one import statement imports: the package's modules it names (a
    `from X import Y` names X, and X.Y when that is a module), or an outside dependency's dotted name."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        subs: list[str] = []
    else:
        base = module if is_package else module.rpartition(".")[0]
        if node.level:
            base = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1])
            name = f"{base}.{node.module}" if node.module else base
        else:
            name = node.module or ""
        names = [name]
        subs = [f"{name}.{a.name}" for a in node.names]
    out = []
    for name in names:
        found = name
        while found and found not in modules:
            found = found.rpartition(".")[0]
        out.append((found, True) if found else (name, False))
    out += [(s, True) for s in subs if s in modules]
    if isinstance(node, ast.ImportFrom) and not out[0][1]:  # `from mpi4py import MPI` imports mpi4py.MPI
        out += [(f"{names[0]}.{a.name}", False) for a in node.names]
    return out


def imports(root: str) -> list[Import]:
    """Every import arrow of the package under `root`, module level and lazy, internal and outside."""
    modules = package_modules(root)
    top = os.path.basename(os.path.abspath(root))
    statements = []
    for module, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        level = _module_level(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                statements.append((module, node, id(node) not in level,
                                   _targets(module, path.endswith("__init__.py"), node, modules)))
    # a package whose __init__ imports a module of the package: importing one of its modules runs that first
    running = {m for m, _, _, found in statements if modules[m].endswith("__init__.py") and any(
        internal and t != m and not m.startswith(t + ".") for t, internal in found)}
    out = []
    for module, node, lazy, found in statements:
        for target, internal in list(found):  # importing a.b.c runs the package a.b (and a) first
            while internal and target.count(".") > 1:
                target = target.rpartition(".")[0]
                if target in running and (target, True) not in found:
                    found.append((target, True))
        for target, internal in found:
            if internal and (target == module or target == top or module.startswith(target + ".")):
                continue  # itself, or its own parent package
            out.append(Import(module, target, node.lineno, lazy, internal))
    return out


def cycles(arrows: list[Import]) -> list[list[str]]:
    """The cycles between files: strongly connected components (Tarjan) of more than one module of the
    graph of internal arrows, module level and lazy alike, each sorted, in order of their first module."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        if a.internal:
            graph.setdefault(a.source, set()).add(a.target)
            graph.setdefault(a.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative, so a deep graph needs no recursion limit
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def layer(module: str) -> int:
    """The index in `LAYERS` of `module`'s layer (longest matching prefix); ValueError if none names it."""
    best, where = -1, None
    for i, (_, prefixes, _) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, where = len(p), i
    if where is None:
        raise ValueError(f"{module} is in no layer of dev/structure.py's LAYERS: add its prefix to one")
    return where


def wrong_way(arrows: list[Import]) -> list[Import]:
    """The internal arrows from a lower layer to a higher one."""
    return [a for a in arrows if a.internal and a.target.count(".") and layer(a.source) < layer(a.target)]


def _lazy_dependency(name: str) -> str | None:
    return next((d for d in LAZY if name == d or name.startswith(d + ".")), None)


def _chains(start: str, eager: dict[str, list[str]]) -> dict[str, list[str]]:
    """{LAZY dependency: the shortest chain of module-level imports from `start` to it}."""
    path = {start: [start]}
    todo = [start]
    found: dict[str, list[str]] = {}
    dep = _lazy_dependency(start)
    if dep:
        found[dep] = [dep]
    while todo:  # breadth first
        module = todo.pop(0)
        for target in eager.get(module, []):
            if target in path:
                continue
            path[target] = path[module] + [target]
            dep = _lazy_dependency(target)
            if dep and dep not in found:
                found[dep] = path[module] + [dep]
            todo.append(target)
    return found


def lazy_reason(arrow: Import, arrows: list[Import]) -> str | None:
    """Why `arrow` may be lazy: the `LAZY` dependency it imports, itself or through the module-level
    imports of the package's modules ("mpiasgd.launch -> mpi4py.MPI"), that its module does not import
    at module level already; None if there is none."""
    if arrow.internal and arrow.source in LAZY_MODULES:
        return f"LAZY_MODULES[{arrow.source}]"
    eager: dict[str, list[str]] = {}
    for a in arrows:
        if not a.lazy:
            eager.setdefault(a.source, []).append(a.target)
    have = _chains(arrow.source, eager)
    deps = _chains(arrow.target, eager) if arrow.internal else (
        {d: [d] for d in [_lazy_dependency(arrow.target)] if d})
    for dep, chain in sorted(deps.items(), key=lambda kv: len(kv[1])):
        if dep not in have:
            return " -> ".join(chain)
    return None


def lazy_imports(arrows: list[Import]) -> tuple[list[tuple[Import, str]], list[Import]]:
    """The lazy import statements (one entry per statement and kind, internal or outside): those allowed,
    each with the reason (`lazy_reason` of one of its arrows), and the rest. A statement stands as its most
    specific arrow (`from mpiasgd.ops import cpu_kernels`: mpiasgd.ops.cpu_kernels, not mpiasgd.ops)."""
    statements: dict[tuple, list[Import]] = {}
    for a in arrows:
        if a.lazy:
            statements.setdefault((a.source, a.line, a.internal), []).append(a)
    allowed, rest = [], []
    for group in statements.values():
        group.sort(key=lambda a: -len(a.target))
        reasons = [(a, lazy_reason(a, arrows)) for a in group]
        found = [(a, r) for a, r in reasons if r is not None]
        if found:
            allowed.append(found[0])
        else:
            rest.append(group[0])
    return allowed, rest


MODE_NAMES = {"async", "ssp", "sync", "pipeline", "easgd"}  # (modes/registry.py MODES)


def names_a_mode(node: ast.AST) -> bool:
    """`node` is a mode's name ("sync"), a collection of them, or a constant that lists modes (`PS_MODES`)."""
    if isinstance(node, ast.Constant):
        return node.value in MODE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(names_a_mode(e) for e in node.elts)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.endswith("MODES")


def mode_branches(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            is_mode = [(s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", "")) == "mode" for s in sides]
            if any(is_mode) and any(names_a_mode(s) for s, m in zip(sides, is_mode, strict=True) if not m):
                count += 1
    return count


def main(argv: list[str]) -> int:
    flags = [a for a in argv if a.startswith("-")]
    argv = [a for a in argv if not a.startswith("-")]
    root = argv[0] if argv else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpiasgd")
    classes, functions, branches = [], [], []
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, os.path.dirname(root))
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
            inside = os.sep + "modes" + os.sep in path or path.endswith(os.sep + "config.py")
            n = mode_branches(tree)
            if n and not inside:
                branches.append((n, rel))
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    print("largest classes:   " + ", ".join(f"{name} {n}" for n, name in classes[:3]))
    print("largest functions: " + ", ".join(f"{name} {n}" for n, name in functions[:3]))
    total = sum(n for n, _ in branches)
    print(f"mode branches outside modes/ and config: {total}" + (" (" + ", ".join(
        f"{rel} {n}" for n, rel in sorted(branches, reverse=True)) + ")" if branches else ""))

    arrows = imports(root)
    found = cycles(arrows)
    print(f"cycles between files: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    wrong = wrong_way(arrows)
    print(f"wrong-way arrows (LAYERS, lowest first: {' < '.join(name for name, _, _ in LAYERS)}): {len(wrong)}")
    for a in wrong:
        print(f"  {a.source}:{a.line} ({LAYERS[layer(a.source)][0]}) -> {a.target} ({LAYERS[layer(a.target)][0]})")
    allowed, rest = lazy_imports(arrows)
    by_reason: dict[str, int] = {}
    for _, reason in allowed:
        key = reason.rsplit(" -> ", 1)[-1]
        by_reason[key] = by_reason.get(key, 0) + 1
    print(f"in-function imports: {len(allowed) + len(rest)}: on the allow list {len(allowed)} ("
          + ", ".join(f"{d} {n}" for d, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
          + f"), other {len(rest)}")
    for a in rest:
        print(f"  other {a.source}:{a.line} {a.target}")
    if "-v" in flags:
        for a, reason in allowed:
            print(f"  lazy  {a.source}:{a.line} {a.target}  ({reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
