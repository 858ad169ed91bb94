"""`mpiasgd simulate`: a cluster of N workers replayed in one process, without MPI, on a virtual clock.

    python -m mpiasgd simulate --workers 8 --model digits --epochs 2 --compute-s 0.05 --latency-s 0.001
    python -m mpiasgd simulate --workers 16 --fit runs/c10-4w.h5 --model cifar10 --epochs 10 \\
        --save-profile c10.json                       # timing fitted from a real 4-worker run, 16 workers
    python -m mpiasgd simulate --workers 32 --profile c10.json --model cifar10 --nsync 4 --warm-start 60

Every `mpiasgd train` option applies (the same parser and config); seconds in them (--warm-start,
--eval-interval, --max-time, --snapshot-interval, --checkpoint-interval) are virtual seconds, except
--flush-interval (the log is written in real time). The timing model comes from --profile, --fit or the
quick flags; quick flags given with --profile or --fit replace those figures of it. A fitted model (or a
profile saved from one) applies the fitted run's --straggler factors, so that it reproduces that run, unless
--straggler is given: then that replaces them; a warning says when its compute times were measured with
another --batch-size or on another network (`timing.mismatch_warnings`). --backend auto computes on cpu, as
`train`'s workers without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from typing import Any

import mpi4py

from mpiasgd.config import Config, ConfigError, resolve
from mpiasgd.config import make_parser as train_parser
from mpiasgd.runlog import RunLogError
from mpiasgd.signals import Terminated
from mpiasgd.sim.timing import (
    ProfileError,
    TimingModel,
    check_profile_path,
    fit_run_log,
    load_profile,
    straggler_text,
)

__all__ = ["Terminated", "check_profile_path", "main", "make_parser"]  # (the first two lived here)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # as a shell reports SIGINT
EXIT_TERMINATED = 143  # as a shell reports SIGTERM


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def make_parser() -> argparse.ArgumentParser:
    """`mpiasgd train`'s parser (every config key) plus --workers and the timing model's flags."""

    parser = train_parser("mpiasgd simulate")
    parser.description = ("Simulate asynchronous SGD (modes async and ssp) with N virtual workers in one process, "
                          "without MPI: real gradients and the real parameter server, on a virtual clock whose "
                          "timing comes from a model (--compute-s ..., --profile or --fit). Writes a run log "
                          "in virtual seconds.")
    sim = parser.add_argument_group("simulation (virtual seconds)")
    sim.add_argument("--workers", type=int, default=None, metavar="N", help="virtual workers (ranks 1..N), N >= 1")
    sim.add_argument("--profile", metavar="FILE.json", default=None, help="timing model from this JSON profile "
                     "(see mpiasgd.sim.timing; --save-profile writes one)")
    sim.add_argument("--fit", metavar="RUN.h5", default=None, help="timing model fitted from this run log of an "
                     "async or ssp run: each worker's measured compute times (in a random order, each once a "
                     "pass; its first push's start-up paid once), the run's --straggler factors, the round "
                     "trip's latency, the server's time per update; by default the simulation reproduces that "
                     "run, and a line says what the fit took. --straggler RANK:FACTOR replaces the run's "
                     "factors (RANK:1: that worker at its device's speed); the timing flags replace their "
                     "figures")
    sim.add_argument("--fit-replay", action="store_true", help="with --fit: each worker replays its measured "
                     "compute times in their order (a trace-driven simulation) instead of in a random order")
    sim.add_argument("--compute-s", type=float, default=None, metavar="SECONDS",
                     help="compute seconds per minibatch of every worker (lognormal mean)")
    sim.add_argument("--compute-cv", type=float, default=None, metavar="CV",
                     help="coefficient of variation of the compute time (default 0: always --compute-s)")
    sim.add_argument("--latency-s", type=float, default=None, metavar="SECONDS",
                     help="seconds per message, one way (default 0)")
    sim.add_argument("--bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                     help="bytes/s of each link (default 0 = infinite)")
    sim.add_argument("--server-s", type=float, default=None, metavar="SECONDS",
                     help="seconds the parameter server takes per push it serves (default 0)")
    sim.add_argument("--eval-s-per-image", type=float, default=None, metavar="SECONDS",
                     help="seconds per test image evaluated (default: compute seconds / batch size / 3)")
    sim.add_argument("--fail", metavar="W@T[,W@T...]", default=None,
                     help="worker rank W dies at T virtual seconds: rank 0 drops it and the run goes on, as under "
                          "ULFM (docs/training.md, 'Workers that die'); modes async and ssp (any --servers); a time "
                          "past the run's end kills no one")
    sim.add_argument("--join", metavar="W@T[,W@T...]", default=None,
                     help="worker rank W is not in the run until T virtual seconds, then pulls the current weights "
                          "and trains; until then the others read shares of its data (a model of a worker that "
                          "joins a running job; T past the run's stop: it only evaluates)")
    sim.add_argument("--save-profile", metavar="FILE.json", default=None,
                     help="write the timing model used (defaults filled in) to this JSON file")
    return parser


def timing_from(args: argparse.Namespace) -> Any:
    """The TimingModel the flags give: --profile's or --fit's with any quick flag replacing that figure, or
    the quick model. ProfileError (a ConfigError) naming the file or the flag when it is not valid."""

    if args.fit_replay and not args.fit:
        raise ProfileError("--fit-replay needs --fit RUN.h5 (the measured times it replays)")
    if args.profile and args.fit:
        raise ProfileError("--profile and --fit: give one timing model")
    if args.compute_cv is not None and args.compute_s is None:
        raise ProfileError("--compute-cv needs --compute-s (the mean it varies around)")
    if not (args.profile or args.fit):
        if args.compute_s is None:
            raise ProfileError("no timing model: give --compute-s SECONDS (with --compute-cv, "
                               "--latency-s, --bandwidth, --server-s as needed), --profile FILE.json or --fit RUN.h5")
        return TimingModel.quick(args.compute_s, args.compute_cv or 0.0, args.latency_s or 0.0, args.bandwidth or 0.0,
                                 args.server_s or 0.0, args.eval_s_per_image)
    base = load_profile(args.profile) if args.profile else fit_run_log(args.fit, replay=args.fit_replay)
    values = base.to_dict()
    if args.compute_s is not None:  # every worker's compute time, theirs included
        values["compute"] = {"mean_s": args.compute_s, "cv": args.compute_cv or 0.0}
        values.pop("workers", None)
    for key in ("latency_s", "bandwidth", "server_s", "eval_s_per_image"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return TimingModel.from_dict(values, f"{'--profile' if args.profile else '--fit'} with the timing flags")


def with_stragglers(cfg: Config, timing: Any, num_workers: int) -> Any:
    """`cfg` with the timing model's `stragglers` (the --straggler of the run it was fitted from, of workers
    1..num_workers) as its --straggler when it gives none of its own; else `cfg` as it is."""


    kept = {w: f for w, f in timing.stragglers.items() if w <= num_workers}
    if cfg.straggler.strip() or not kept:
        return cfg
    return dataclasses.replace(cfg, straggler=straggler_text(kept))


def fit_line(path: str, timing: Any, cfg: Config, num_workers: int) -> str:
    """One line: what --fit took from run log `path` (`timing`, the fitted model) and what this run of
    `num_workers` workers (`cfg`, after `with_stragglers`) applies of it."""

    slow = cfg.stragglers()
    speeds = []
    for w, c in sorted(timing.workers.items()):
        factor = slow.get(w, 1.0)
        times = f"{c.mean:.3g} s x {factor:g} = {c.mean * factor:.3g} s" if factor != 1 else f"{c.mean:.3g} s"
        speeds.append(f"worker {w} {times}" + (f" (start-up +{c.startup_s * factor:.2g} s once)" if c.startup_s
                                                else ""))
    measured = ", ".join(speeds) or f"every worker {timing.compute.describe()} (--compute-s)"
    run = straggler_text(timing.stragglers) or "(none)"
    kept = {w: f for w, f in timing.stragglers.items() if w <= num_workers}
    if slow != kept:
        applied = f"the run's --straggler {run} replaced by this run's --straggler {straggler_text(slow)}"
    elif kept:
        applied = f"the run's --straggler {run} applied, as measured (--straggler RANK:1 undoes it)"
    elif timing.stragglers:
        applied = f"the run's --straggler {run}: of no simulated worker"
    else:
        applied = "no --straggler in the run"
    return (f"mpiasgd simulate: --fit '{path}' took: compute per minibatch {measured}; {applied}; latency "
            f"{timing.latency_s:.3g} s, server {timing.server_s:.3g} s per update (each replaced by its flag: "
            "--straggler, --compute-s, --latency-s, --server-s)")


def main(argv: list[str]) -> int:
    """`mpiasgd simulate ARGV`; returns the exit status (2: bad input, one line on stderr)."""
    # no MPI here: mpiasgd's modules import mpi4py.MPI (for its constants), which must not initialise MPI
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

    parser = make_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    from mpiasgd.launch.startup import STARTUP_ERRORS
    from mpiasgd.rank0.recorder import TrainingDiverged
    from mpiasgd.sim.run import simulate

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        args = parser.parse_args(argv)
        cfg = resolve(args)
        if args.workers is None:
            raise ConfigError("--workers N is required (the virtual workers, ranks 1..N)")
        from mpiasgd.sim.engine import check_simulated, parse_failures, parse_joins

        failures, joins = parse_failures(args.fail, args.workers), parse_joins(args.join, args.workers)
        check_simulated(cfg, args.workers, failures, joins)
        timing = timing_from(args)
        cfg = with_stragglers(cfg, timing, args.workers)
        if args.fit:
            print(fit_line(args.fit, timing, cfg, args.workers), flush=True)
        if args.save_profile:  # refused here; written once the run has started (every other check passed)
            check_profile_path(args.save_profile, args.fit, cfg.overwrite)
        return simulate(cfg, args.workers, timing, save_profile=args.save_profile, failures=failures, joins=joins)
    except RunLogError as e:  # the log cannot be written (disk full): one line, the log ended as far as it can be
        outcome = getattr(e, "outcome", "")
        print(f"mpiasgd simulate: error: {e}{'; ' + outcome if outcome else ''}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except STARTUP_ERRORS as e:  # bad input: one line
        print(f"mpiasgd simulate: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except TrainingDiverged as e:  # --max-rejects: the log is closed 'failed' and says so
        print(f"mpiasgd simulate: error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Terminated:  # SIGTERM (kill, a scheduler): as Ctrl-C
        print("mpiasgd simulate: terminated (SIGTERM); the run log (if it was created) is closed with status "
              "'failed'", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # Ctrl-C: the log (if it was created) is closed 'failed'
        print("mpiasgd simulate: interrupted (Ctrl-C); the run log (if it was created) is closed with status "
              "'failed'", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
