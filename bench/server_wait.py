#!/usr/bin/env python3
"""How long a worker waits for the parameter server's reply, with the server spinning on its requests
(`--server-wait spin`) and sleeping between polls (`--server-wait backoff`): real `mpiexec` jobs side by
side, alternating, the median of the worker's wait per push of each run, and the ratio spin / backoff.

    python bench/server_wait.py                            # digits, 1 server + 1 worker, 1000 pushes a run, 5 rounds
    python bench/server_wait.py --pushes 3000 --rounds 7   # longer runs, more rounds
    python bench/server_wait.py --dry-run                  # 1 round of 20-push runs: every code path in seconds (CI)

What is measured: the pushes table of each run log has, per push, `wait_s` (seconds the worker waited for
the server's reply after its push was sent) and `comm_s` (posting the push and the receive); a worker that
waits for a server sleeping between polls waits for the server's oversleep too (`time.sleep` of 10 us to
2 ms sleeps longer, the more so on a loaded node). Per run the median over its applied pushes; per setting
the median over the rounds; the ratio spin / backoff of those medians (below 1: spinning answers sooner) and
per round. Every run gets the same flags but --server-wait:

    --model MODEL --batch-size B --epochs 0 --max-pushes PUSHES --threads 1 --snapshot-interval 0

`--threads 1`: a worker alone on a node otherwise takes every core for BLAS threads, the one the spinning
server owns included. Spinning only pays where the server has a core of its own: run it with 1 server +
WORKERS workers on at least 1 + WORKERS cores (the script says when the node has fewer). Each run's log
must record the wait asked for (its event `server_wait`), else the script stops with an error.

Every command has a time limit (`--timeout`); a failure prints the command and its output and exits with
status 1. The exact commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import numpy as np
from trainrun import Trainer, add_benchmark_arguments, cores, rounds

from mpiasgd.argtypes import positive

WAITS = ("spin", "backoff")  # the settings compared, in the order of the first round; the ratio is spin / backoff
DRY_PUSHES = 20  # --dry-run: pushes per run (one round)


def median_ms(log: dict, column: str) -> float:
    """Median of `column` (seconds) over the applied pushes of a run log, in milliseconds."""
    pushes = log["pushes"]
    return 1e3 * float(np.median(pushes[column][pushes["applied"] == 1]))


def recorded_wait(log: dict) -> str:
    """The text of the run log's "server_wait" event (what rank 0 said at start), "" if it has none."""
    events = log.get("events")
    texts = [] if events is None else [row["text"] for row in events if row["kind"] in (b"server_wait", "server_wait")]
    return (texts[0].decode() if isinstance(texts[0], bytes) else str(texts[0])) if texts else ""


def check_recorded(log: dict, wait: str) -> str:
    """The "server_wait" event of a run asked for `wait`; exits naming the log when it says another wait."""
    said = recorded_wait(log)
    expected = "spins on its requests" if wait == "spin" else "sleeps between polls"
    if expected not in said:
        sys.exit(f"{sys.argv[0]}: run log {log['path']} does not record --server-wait {wait} (its server_wait event: "
                 f"{said!r})")
    return said


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = parser.add_argument_group("workload (the same for both settings)")
    work.add_argument("--model", default="digits", choices=("digits", "cifar10"),
                      help="network and dataset (default: %(default)s)")
    work.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    work.add_argument("--batch-size", type=positive, default=32,
                      help="minibatch per worker, images (default: %(default)d)")
    work.add_argument("--workers", type=positive, default=1,
                      help="workers beside the one server (default: %(default)d)")
    work.add_argument("--pushes", type=positive, default=1000,
                      help="pushes of each run, --max-pushes (default: %(default)d)")
    bench = add_benchmark_arguments(parser, rounds=5, timeout=300.0)
    bench.add_argument("--dry-run", action="store_true",
                       help=f"1 round of {DRY_PUSHES}-push runs: every step of the script in seconds, no measurement")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.pushes, args.rounds = DRY_PUSHES, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    options = ["--model", args.model, *(["--data-dir", args.data_dir] if args.data_dir else []),
               "--batch-size", str(args.batch_size), "--epochs", "0", "--max-pushes", str(args.pushes),
               "--threads", "1", "--snapshot-interval", "0"]
    ranks, here = 1 + args.workers, cores()
    print(f"workload: {args.model} network, 1 server + {args.workers} async worker{'s' * (args.workers > 1)}, batch "
          f"{args.batch_size}, {args.pushes} pushes a run, --threads 1, --server-wait {' | '.join(WAITS)}, "
          f"{args.rounds} round{'s' * (args.rounds > 1)}, {here} cores" + (" (dry run)" if args.dry_run else ""),
          flush=True)
    if here < ranks:
        print(f"note: {ranks} ranks on {here} cores: the spinning server takes a worker's core; spin pays only with a "
              "core per rank", flush=True)

    def show(r: int, wait: str, log: dict) -> None:
        said = check_recorded(log, wait)
        print(f"round {r}: {wait:<7}  wait {median_ms(log, 'wait_s'):7.3f} ms  "
              f"comm {median_ms(log, 'comm_s'):6.3f} ms  compute {median_ms(log, 'compute_s'):7.3f} ms  "
              f"(medians of {int(log['version'])} pushes; {said})", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args.run_dir or tmp, args.timeout)
        runs = {wait: (lambda name, wait=wait: trainer.train(args.workers, [*options, "--server-wait", wait], name))
                for wait in WAITS}
        logs = rounds(runs, args.rounds, show)

    waits = {w: [median_ms(log, "wait_s") for log in logs[w]] for w in WAITS}
    comms = {w: [median_ms(log, "comm_s") for log in logs[w]] for w in WAITS}
    median = {w: statistics.median(waits[w]) for w in WAITS}
    print(f"\nmedians of {args.rounds} round{'s' * (args.rounds > 1)} (each run: the median over its pushes), ms")
    print("| server wait | worker's wait per push | comm per push | per round (wait) |")
    print("|---|---:|---:|---|")
    for w in WAITS:
        print(f"| {w} | {median[w]:.3f} | {statistics.median(comms[w]):.3f} | "
              f"{', '.join(f'{v:.3f}' for v in waits[w])} |")
    per_round = ", ".join(ratio(s, b) for s, b in zip(waits["spin"], waits["backoff"], strict=True))
    print(f"\nspin / backoff, the worker's wait per push: {ratio(median['spin'], median['backoff'])} "
          f"({median['spin']:.3f} against {median['backoff']:.3f} ms; per round: {per_round})")
    trainer.print_commands()
    return 0


if __name__ == "__main__":
    sys.exit(main())
