"""Command line: `mpiasgd train | simulate | evaluate | report | watch | trace | export | data | attach` (also
`python -m mpiasgd ...`).

    mpiexec -n 3 python -m mpiasgd train --model digits --epochs 30   # 1 parameter server + 2 workers
    python -m mpiasgd simulate --workers 8 --compute-s 0.05           # 8 virtual workers, one process, no MPI
    python -m mpiasgd evaluate runs/NAME.h5                            # accuracy of every weight snapshot
    python -m mpiasgd report runs/NAME.h5 [runs/OTHER.h5 ...]          # summary tables, runs compared
    python -m mpiasgd watch runs/NAME.h5                               # follow a running job, a line per interval
    python -m mpiasgd trace runs/NAME.h5 -o trace.json                 # Chrome trace, one track per rank
    python -m mpiasgd export runs/NAME.h5 -o NAME.npz                  # weights as .npz, keyed by parameter name
    python -m mpiasgd data convert SRC OUT.h5 [--size S]               # dataset file (also: data synth, data info)
    python -m mpiasgd attach runs/NAME.attach --model digits           # bring back a job's lost workers (--attach)
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
import traceback

import mpi4py  # (the package alone: `mpi4py.MPI`, which starts MPI, is imported by `train` only)

from mpiasgd import __version__
from mpiasgd.argtypes import DEFAULT_TARGET, FORMATS, command, fraction, positive, seconds
from mpiasgd.tools.data_cli import add_parser as add_data_parser  # argparse only: `train` loads no data tools

# the validators lived here before mpiasgd.argtypes: scripts that import them from here still run
__all__ = ["DEFAULT_TARGET", "FORMATS", "command", "fraction", "main", "make_parser", "positive", "seconds"]


def make_parser() -> argparse.ArgumentParser:
    """The `mpiasgd` parser: its commands and their flags (`train` and `simulate` take theirs from
    `mpiasgd.config.make_parser` and `mpiasgd.sim.cli.make_parser`; here they take the rest of the line)."""
    parser = argparse.ArgumentParser(prog="mpiasgd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"mpiasgd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("train", help="train (run under mpiexec/srun: rank 0 server, ranks 1..N workers)",
                   add_help=False)
    sub.add_parser("simulate", help="simulate N workers in one process on a virtual clock (no MPI; modes async, "
                   "ssp): real gradients and server, modelled timing", add_help=False)
    ev = command(sub, "evaluate", "evaluate every weight snapshot of a run log on the test set")
    ev.add_argument("logs", nargs="+", metavar="RUN.h5", help="run logs written by mpiasgd train (runs/NAME.h5)")
    ev.add_argument("--data-dir", default=None, help="where the dataset is (default: the run's own)")
    ev.add_argument("--every", type=positive, default=1, help="evaluate every N-th snapshot and the last (default 1)")
    ev.add_argument("--batch-size", type=positive, default=256, help="images per forward pass (default 256)")
    rp = command(sub, "report", "print summary tables of run logs, and a table comparing them")
    rp.add_argument("logs", nargs="+", metavar="RUN.h5", help="run logs written by mpiasgd train (runs/NAME.h5)")
    rp.add_argument("--target-accuracy", type=fraction, default=DEFAULT_TARGET, metavar="FRACTION",
                    help="test accuracy of the comparison's 'time to' column, a fraction: 0.6 = 60 %% "
                         f"(default {DEFAULT_TARGET}; values above 1 are refused)")
    rp.add_argument("--plots", metavar="DIR", default=None,
                    help="also write PNG plots into DIR: accuracy and loss against time and epochs (runs overlaid), "
                         "staleness per worker, time split per worker")
    rp.add_argument("--format", choices=FORMATS, default="text",
                    help="text (default): each run's report, then the comparison table for 2+ runs; "
                         "markdown | csv: the comparison table alone")
    wt = command(sub, "watch", "follow a running job's log and print a line per interval until it ends")
    wt.add_argument("log", metavar="RUN.h5", help="the run log of a running (or ended) job (runs/NAME.h5)")
    wt.add_argument("--interval", type=seconds, default=2.0, help="seconds between lines (default 2)")
    wt.add_argument("--wait", type=float, default=60.0,
                    help="seconds to wait for the log to appear, for a job still starting (default 60)")
    tr = command(sub, "trace", "write a Chrome trace of a run (Perfetto, chrome://tracing): a track per rank")
    tr.add_argument("log", metavar="RUN.h5", help="a run log written by mpiasgd train (runs/NAME.h5)")
    tr.add_argument("-o", "--output", default="trace.json", help="the JSON file to write (default trace.json)")
    ex = command(sub, "export", "write a run's weights to a NumPy .npz keyed by parameter name (see "
                                "docs/networks.md, Model export)")
    ex.add_argument("log", metavar="RUN.h5", help="a run log written by mpiasgd train (runs/NAME.h5)")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--snapshot", type=int, default=None, metavar="N",
                       help="weight snapshot N of the log, from 0 (negative: from the end; default: the last)")
    which.add_argument("--checkpoint", action="store_true",
                       help="the run's checkpoint (RUN.ckpt.h5) instead of a snapshot")
    ex.add_argument("-o", "--output", default=None, help="the .npz file to write (default: RUN.npz beside the log)")
    at = command(sub, "attach", "bring back worker ranks a running job (train --attach) lost: rank 0 starts them "
                                "(the network and dataset flags after these must be the job's)")
    at.add_argument("file", metavar="RUN.attach", help="the job's attach file, beside its run log (runs/NAME.attach)")
    at.add_argument("--host", default="", help="where rank 0 starts the workers (a host of the launcher's allocation; "
                                               "default: where MPI places them)")
    at.add_argument("--count", type=int, default=0, help="how many lost worker ranks to bring back (default 0: all)")
    at.add_argument("--timeout", type=seconds, default=60.0, help="seconds to wait for rank 0's answer (default 60)")
    add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args, rest = parser.parse_known_args(argv)

    if args.command == "train":
        return _train(rest)
    if args.command == "simulate":
        from mpiasgd.sim.cli import main as simulate

        return simulate(rest)
    if args.command == "attach":
        return _attach(args, rest)
    if rest:
        from mpiasgd.config import flag_hint

        flags = _leaf(parser, args)._option_string_actions
        parser.error(f"unrecognized arguments: {' '.join(rest)}{flag_hint(rest, flags)}")
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "trace":
        from mpiasgd.tools.trace import main as trace

        return trace(args.log, args.output)
    if args.command == "export":
        return _export(args)
    if args.command == "data":
        from mpiasgd.tools.data_cli import main as data

        return data(args)
    if args.command == "watch":
        from mpiasgd.tools.watch import main as watch

        return watch(args.log, args.interval, args.wait)
    return _report(args)


def _leaf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser whose flags `args` were parsed by: the subcommand's, or `data`'s action's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return _leaf(action.choices[getattr(args, action.dest)], args)
    return parser


def _train(argv: list[str]) -> int:
    from mpiasgd import signals
    from mpiasgd.config import ConfigError, make_parser, resolve

    signals.install()  # SIGTERM, SIGUSR1, SIGINT from now on: checkpoint and end the run (exit status 75)

    parser = make_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    try:
        cfg = resolve(parser.parse_args(argv))
    except ConfigError as e:
        error = str(e)
    else:
        error = None
    from mpi4py import MPI  # MPI starts only for training

    from mpiasgd.comms import ulfm
    from mpiasgd.launch import EXIT_BAD_INPUT, train

    comm = MPI.COMM_WORLD
    exits = ulfm.enabled() and ulfm.detector_thread()  # ULFM's detector thread keeps MPI_Finalize from returning
    try:
        try:
            bad = any(comm.allgather(error))  # every rank parsed the same argv: one message, from rank 0
        except (MPI.Exception, pickle.UnpicklingError) as e:  # (a rank died mid-gather: its bytes may be garbage)
            if not (ulfm.is_failure(e) or (ulfm.enabled() and isinstance(e, pickle.UnpicklingError))):
                raise
            print(f"mpiasgd: error: rank {comm.Get_rank()}: {ulfm.dead_ranks(comm)} of the job died during start-up "
                  f"(ULFM reported it: {e}); the job ends", file=sys.stderr, flush=True)
            status = 1
        else:
            if bad:
                if comm.Get_rank() == 0:
                    print(f"mpiasgd: error: {error}", file=sys.stderr)
                status = EXIT_BAD_INPUT
            else:
                try:
                    status = train(cfg, comm)
                finally:
                    signals.ignore()
    except BaseException as e:
        if not exits:
            raise
        if ulfm.is_failure(e) and MPI.Comm.Get_parent() != MPI.COMM_NULL:  # (--respawn) a replacement: rank 0 died
            print(f"mpiasgd: error: replacement worker (pid {os.getpid()}): rank 0 died, which it cannot go on "
                  f"without (ULFM reported it: {e}); it ends", file=sys.stderr, flush=True)
        elif ulfm.is_failure(e):  # e.g. rank 0 died: a worker's wait for it fails
            print(f"mpiasgd: error: rank {comm.Get_rank()}: {ulfm.dead_ranks(comm)} died, which this rank cannot go on "
                  f"without (ULFM reported it: {e}); this rank ends", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()  # (then out at once: Python's own exit would call MPI_Finalize and hang)
        status = 1
    if exits:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return _leave_stray_threads(status, comm.Get_rank())


def _leave_stray_threads(status: int, rank: int) -> int:
    """`status`, or, when threads that Python would wait for at exit are still running (a --model file's:
    no thread of mpiasgd outlives `train`), a warning naming them, then MPI_Finalize and exit with
    `status` at once: a user's thread must not keep the job from ending."""
    stray = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not stray:
        return status
    print(f"mpiasgd: warning: rank {rank}: thread(s) {', '.join(stray)} still running (started by the --model "
          "file?): exiting without waiting for them", file=sys.stderr, flush=True)
    sys.stdout.flush()
    from mpi4py import MPI

    MPI.Finalize()
    os._exit(status)


def _attach(args: argparse.Namespace, rest: list[str]) -> int:
    """`mpiasgd attach RUN.attach [--host H] [--count K] TRAIN-FLAGS`: ask the job to bring back its lost worker
    ranks (`mpiasgd.rank0.attach`); the network and dataset of TRAIN-FLAGS must be the job's. 0 when rank 0 started
    them, 2 when it refused (its reason printed) or could not be reached."""
    mpi4py.rc.initialize = False  # no MPI here: mpiasgd's modules import mpi4py.MPI, which must not start MPI (a
    mpi4py.rc.finalize = False    # singleton MPI_Init takes seconds: the job's end may come first)
    from mpiasgd.config import make_parser, resolve
    from mpiasgd.launch.startup import definition_text, load_data
    from mpiasgd.rank0.attach import identity, request

    if args.count < 0:
        print(f"mpiasgd attach: error: --count {args.count}: expected an integer >= 0 (0: every lost rank)",
              file=sys.stderr)
        return 2
    try:
        cfg = resolve(make_parser().parse_args(rest))
        dataset = load_data(cfg)
        ident = identity(definition_text(cfg, dataset), cfg.dataset_name, dataset.fingerprint)
        reply = request(args.file, ident, args.host, args.count, args.timeout)
    except (OSError, ValueError) as e:  # (ConfigError, DataError, ModelSpecError are ValueErrors)
        print(f"mpiasgd attach: error: {e}", file=sys.stderr)
        return 2
    if not reply.get("ok"):
        print(f"mpiasgd attach: refused by rank 0: {reply.get('error')}", file=sys.stderr)
        return 2
    print(f"mpiasgd attach: {reply.get('text')}; the run log's events say when each joins (event worker_joined)",
          flush=True)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from mpiasgd.tools.evaluate import SNAPSHOT_HEADER, evaluate_snapshots, snapshot_line

    header = True  # the table's header goes before a log's first row, not before an error

    def show(r) -> None:
        nonlocal header
        if header:
            print(SNAPSHOT_HEADER, flush=True)
            header = False
        print(snapshot_line(r), flush=True)

    def warn(text: str) -> None:
        print(f"mpiasgd evaluate: warning: {text}", file=sys.stderr, flush=True)

    status = 0
    for path in args.logs:
        print(f"== {path}", flush=True)
        header = True
        try:
            rows = evaluate_snapshots(path, args.data_dir, args.batch_size, args.every, show, warn)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            print(f"mpiasgd evaluate: error: {e}", file=sys.stderr)
            status = 2
            continue
        print(f"{len(rows)} snapshots evaluated and stored in {path}")
    return status


def _export(args: argparse.Namespace) -> int:
    from mpiasgd.tools.export import export_run

    stem = args.log[:-3] if args.log.endswith(".h5") else args.log
    output = args.output or (stem[:-5] if stem.endswith(".ckpt") else stem) + ".npz"
    try:
        print(export_run(args.log, output, args.snapshot, args.checkpoint), flush=True)
    except (OSError, ValueError, KeyError) as e:
        print(f"mpiasgd export: error: {e}", file=sys.stderr)
        return 2
    return 0


def _report(args: argparse.Namespace) -> int:
    from mpiasgd.tools.report import report

    try:  # every log is read before anything is printed: a bad one stops the whole report
        text = report(args.logs, args.target_accuracy, args.format)
    except (OSError, ValueError, KeyError) as e:
        print(f"mpiasgd report: error: {e}", file=sys.stderr)
        return 2
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `mpiasgd report ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.plots:
        from mpiasgd.runlog import load
        from mpiasgd.tools.plots import plot_runs

        try:
            paths = plot_runs([load(path) for path in args.logs], args.plots)
        except OSError as e:
            print(f"mpiasgd report: error: cannot write plots into '{args.plots}': {e}", file=sys.stderr)
            return 2
        print("plots: " + ", ".join(paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
