"""The path of one push through rank 0, traced: the package's files and classes a PUSH crosses from the loop's
`handle` to the reply, and the calls in each.

    python dev/push_path.py [--mode async|ssp|easgd] [--calls]

It builds an async server on 2 workers in-process (`tests/kit/server.py`: the fake communicator, no MPI),
serves a first push (start-up work: compiled code, first allocations), then traces the second with
`sys.setprofile` and prints the files and classes of `mpiasgd` whose functions ran, in order of first call.
Issue 37 quotes its counts before and after the push path's refactor.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
from kit.server import make_server, push  # noqa: E402

from mpiasgd.comms import Backoff, probe  # noqa: E402


def trace_push(mode: str) -> list[tuple[str, str]]:
    """(file relative to the repository, qualified name) of every call in `mpiasgd` while rank 0 handles the
    second push of worker 1 in `mode`, in call order."""
    package = str(ROOT / "mpiasgd") + os.sep
    with tempfile.TemporaryDirectory() as tmp:
        server, net, _ = make_server(Path(tmp), mode=mode)
        server.begin()
        for step in (1, 2):
            push(net, 1, step=step, version=step - 1, grad=np.full(6, 0.01, np.float32))
            message = probe(server.comm, 0, 1.0, "test message", Backoff())
            calls: list[tuple[str, str]] = []

            def profile(frame, event, arg, calls=calls):
                if event == "call" and frame.f_code.co_filename.startswith(package):
                    calls.append((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_qualname))

            sys.setprofile(profile if step == 2 else None)
            try:
                server.handle(*message)
            finally:
                sys.setprofile(None)
        return calls


def owner(qualname: str) -> str:
    """The class of a method's qualified name ("" for a function, or a function's nested one)."""
    parts = qualname.split(".")
    return parts[0] if len(parts) > 1 and not parts[1].startswith("<") and not parts[0].startswith("<") else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="async", choices=["async", "ssp", "easgd"])
    parser.add_argument("--calls", action="store_true", help="print every call, in order")
    args = parser.parse_args(argv)
    calls = trace_push(args.mode)
    files = list(dict.fromkeys(f for f, _ in calls))
    classes = list(dict.fromkeys((f, owner(q)) for f, q in calls if owner(q)))
    if args.calls:
        for f, q in calls:
            print(f"  {f}: {q}")
    print(f"a push in {args.mode}: {len(calls)} calls in {len(files)} files and {len(classes)} classes")
    for f in files:
        names = sorted({owner(q) for g, q in calls if g == f and owner(q)})
        print(f"  {f}: {', '.join(names) or '(functions)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
