#!/usr/bin/env python3
"""Structure figures of the mpiasgd package, for the notes of a refactor (issue 17): the largest class
and function (lines), and the branches on the training mode outside `mpiasgd/modes/` and the config.

    python dev/structure.py [PACKAGE_DIR]        # default: mpiasgd/ next to this file's parent

A mode branch is a comparison whose one side is an attribute named `mode` (`cfg.mode == "sync"`,
`self.cfg.mode in (...)`) or a call of it; the registry of modes (`modes/`) and the config, which
checks each mode's keys, are where such knowledge belongs and are not counted.
"""

from __future__ import annotations

import ast
import os
import sys


def mode_branches(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "mode" for s in sides):
                count += 1
    return count


def main(argv: list[str]) -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
