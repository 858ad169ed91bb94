"""Workers killed at random times under ULFM (issue 40): does every run complete, keep every push rank 0
applied, and reach the test accuracy of runs nobody disturbed?

    python bench/elastic.py [--runs 20] [--kills 1,2,3] [--workers 4] [--mode async|ssp|easgd] [--servers 1]
                            [--model digits] [--epochs 100] [--reference 5] [--seed 0] [--respawn | --attach]
                            [--keep DIR]
                            [--dry-run]

First `--reference` undisturbed runs (seeds 0, 1, ...; ULFM on, nobody killed) give the accuracy's run-to-run
noise. Then run i (training seed 100 + i) SIGKILLs k = kills[i % len(kills)] workers, drawn at random, each
once the pushes in the log reach a random epoch in [0.1, 0.7] x --epochs ([0.1, 0.5] with --attach) (numpy seed
(--seed, i); the log is flushed every 0.2 s). Every job is
`mpiexec --with-ft ulfm --mca mpi_ft_detector true --mca mpi_ft_detector_thread true -n N+S python -m mpiasgd
train --mode MODE --servers S ...` under a time limit (ssp: --staleness-bound 3). Each run's checks, printed:

    completed   exit status 0 and the log's status "completed"
    lost        one worker_lost event per victim, naming it; none of its pushes after its death (--respawn:
                a replacement joined within BACK_WITHIN s of the loss, event worker_joined, and pushed as that
                rank; the median and largest of those delays are printed; --attach: once rank 0 logged each
                loss, `mpiasgd attach` brings the rank back: it exits 0, and the worker joins within BACK_WITHIN s
                of the attach and pushes)
    pushes      nothing rank 0 applied is missing from the log: the applied pushes' versions are 1..V, each
                worker's steps 1..its last (--servers S > 1: on each shard the applied versions are 1..V, the
                same V on every shard, and every shard applied the same pushes; a dead worker's push that
                reached some shards only is counted by the others, event "lost_push": noted)
    test        the final evaluation covered the whole test split (the survivors took the dead workers' share;
                a death reported after the stop leaves its share out, said)
    accuracy    the final test accuracy, and its distance to the undisturbed runs' mean in their standard
                deviations

A job that does not start (a rank crashed inside MPI_Init, before any code of mpiasgd ran: Open MPI under
ULFM, docs/training.md) is started again, up to STARTS times in all, and counted.

`--dry-run`: one reference run and one run with one kill, on digits for 20 epochs (300 with --attach) (the code
paths, not the numbers; CI runs it in tests/mpi).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
from launch import distinct_ints, launcher

FT = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true"]
BACK_WITHIN = 10.0  # (--respawn) seconds from a loss to its replacement's join, at most (issue 40)
STARTS = 4  # attempts per job: under ULFM a rank crashes in MPI_Init in a few starts of 25 (more on a loaded machine)


@dataclass
class Outcome:
    """One job: its exit status, the log's figures, the victims and when they were killed (the epoch the log's
    pushes had reached), and the checks that failed."""

    seed: int
    victims: list[int] = field(default_factory=list)
    killed_at: list[float] = field(default_factory=list)
    returncode: int | None = None
    status: str = "-"
    accuracy: float = float("nan")
    test_count: int = 0
    seconds: float = 0.0
    train_s: float = 0.0  # from the first push to the end of the job
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: bool = True  # False: no run log (every rank ended in or right after MPI_Init)
    restarted: bool = False  # an earlier attempt did not start
    back_s: list[float] = field(default_factory=list)  # (--respawn) seconds from each loss to its replacement's join
    attach_s: list[float] = field(default_factory=list)  # (--attach) seconds from each attach to its worker's join


def read(path: Path) -> dict:
    """The log's attributes and the tables the checks read ({} when it cannot be read yet)."""
    try:
        with h5py.File(path, "r", libver="latest", swmr=True) as f:
            out = {key: f.attrs[key] for key in f.attrs}
            for name in ("pushes", "events", "workers", "shard_pushes"):
                out[name] = f[name][()] if name in f else None
            return out
    except (OSError, KeyError):
        return {}


def text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def job(args: argparse.Namespace, tmp: Path, seed: int, victims: list[int], times: list[float],
        num_train: int, num_test: int) -> Outcome:
    """`attempt`, and again (up to STARTS attempts in all) while the job does not start (a rank crashed in
    MPI_Init: Open MPI under ULFM; the outcome says how many times in its notes)."""
    out = attempt(args, tmp, seed, victims, times, num_train, num_test, 0)
    number = 0
    while not out.started and number + 1 < STARTS:
        number += 1
        out = attempt(args, tmp, seed, victims, times, num_train, num_test, number)
    if number:
        out.notes.insert(0, f"started {number} more time(s) after a crash in MPI_Init")
        out.restarted = True
    return out


def attempt(args: argparse.Namespace, tmp: Path, seed: int, victims: list[int], times: list[float],
            num_train: int, num_test: int, number: int) -> Outcome:
    """One training job; SIGKILL each of `victims` once the log's pushes hold its epoch in `times` (of the
    `num_train` training images). Its files are under `tmp`, named after `seed` and the attempt's `number`."""
    seed_name = f"{seed}" if number == 0 else f"{seed}.{number}"
    runs = tmp / f"runs-{seed_name}"
    mode = ["--mode", args.mode] + (["--staleness-bound", "3"] if args.mode == "ssp" else [])
    cmd = [*launcher(), *FT, "-n", str(args.workers + args.servers), sys.executable, "-m", "mpiasgd", "train", *mode,
           "--servers", str(args.servers), "--model", args.model, "--epochs", f"{args.epochs:g}", "--seed",
           str(seed), "--no-progress",
           "--snapshot-interval", "0", "--run-dir", str(runs), "--name", "e", "--flush-interval", "0.2",
           *(["--respawn"] if args.respawn else []), *(["--attach"] if args.attach else [])]
    out = Outcome(seed, victims, times)
    log = runs / "e.h5"
    t0 = time.monotonic()
    with open(tmp / f"out-{seed_name}.txt", "w") as o, open(tmp / f"err-{seed_name}.txt", "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = t0 + args.timeout
        first = None
        pending = sorted(zip(times, victims, strict=True))
        attaches: list[subprocess.Popen] = []  # (--attach) the attach commands, one per loss logged
        while proc.poll() is None and time.monotonic() < deadline:
            got = read(log) if pending or first is None or (args.attach and len(attaches) < len(victims)) else {}
            pushes, rows = got.get("pushes"), got.get("workers")
            if first is None and pushes is not None and len(pushes):
                first = time.monotonic()
            epochs = float(pushes["samples"].sum()) / num_train if pushes is not None else 0.0
            while pending and rows is not None and len(rows) and epochs >= pending[0][0]:
                _, w = pending.pop(0)
                try:
                    os.kill(int(rows["pid"][rows["rank"] == w][0]), signal.SIGKILL)
                except ProcessLookupError:  # (it had exited: the run was ending)
                    out.notes.append(f"worker rank {w} had exited before its kill")
            events = got.get("events")
            lost = 0 if events is None else int((events["kind"] == b"worker_lost").sum())
            while args.attach and len(attaches) < lost and proc.poll() is None:  # each loss logged: bring it back
                attaches.append(attach(args, runs))
            time.sleep(0.05)
        if proc.poll() is None:
            out.failed.append(f"still running after {args.timeout:g} s (killed)")
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        attached(attaches, out)
    out.seconds = time.monotonic() - t0
    out.train_s = time.monotonic() - first if first is not None else 0.0
    out.returncode = proc.returncode
    if pending:
        out.failed.append(f"the run ended before {len(pending)} kill(s)")
    got = read(log)
    if not got:
        said = [line for line in (tmp / f"err-{seed_name}.txt").read_text(errors="replace").splitlines()
                if line.strip()]
        out.started = False
        out.failed.append(f"no readable log (exit status {proc.returncode}; stderr's last lines: "
                          f"{' | '.join(said[-6:]) or 'none'})")
        return out
    said = (tmp / f"err-{seed_name}.txt").read_text(errors="replace")
    if "I have been reported dead by someone else" in said:  # Open MPI's detector, wrong under load
        out.notes.append("Open MPI's failure detector declared a living rank dead and aborted it (a false "
                         "positive under load; docs/training.md: mpi_ft_detector_timeout)")
    out.status = text(got.get("status", "-"))
    out.accuracy = float(got.get("test_accuracy", float("nan")))
    out.test_count = int(got.get("test_count", 0))
    check(out, got, num_test, args.respawn or args.attach)
    return out


def attach(args: argparse.Namespace, runs: Path) -> subprocess.Popen:
    """(--attach) Start `mpiasgd attach runs/e.attach --count 1 --model MODEL` (one per loss; the kills go on
    meanwhile)."""
    cmd = [sys.executable, "-m", "mpiasgd", "attach", str(runs / "e.attach"), "--count", "1", "--model", args.model]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def attached(attaches: list[subprocess.Popen], out: Outcome) -> None:
    """(--attach) Wait for each attach command (60 s at most): a failure (its exit status and words) into
    `out.failed`."""
    for command in attaches:
        try:
            _, err = command.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            command.kill()
            _, err = command.communicate()
        if command.returncode != 0:
            out.failed.append(f"mpiasgd attach exited {command.returncode}: {err.strip()[-300:]}")


def check(out: Outcome, got: dict, num_test: int, respawn: bool = False) -> None:
    """The checks of the module doc, their failures into `out.failed`."""
    if out.returncode != 0 or out.status != "completed":
        out.failed.append(f"exit status {out.returncode}, log status {out.status}")
    events = got["events"]
    lost = [(float(r["time"]), text(r["text"])) for r in events if text(r["kind"]) == "worker_lost"]
    named = sorted(int(t.split()[2]) for _, t in lost)
    if named != sorted(out.victims):
        out.failed.append(f"worker_lost names ranks {named}, killed {sorted(out.victims)}")
    p = got["pushes"]
    joined = [(float(r["time"]), text(r["text"])) for r in events if text(r["kind"]) == "worker_joined"]
    for when, t in lost:
        w = int(t.split()[2])
        if not respawn:
            if (p["time"][p["worker"] == w] > when).any():
                out.failed.append(f"worker rank {w} has pushes after its loss")
            continue
        back = [u for u, j in joined if u >= when and j.startswith(f"worker rank {w} is back: ")]
        if not back:
            out.failed.append(f"worker rank {w} was not replaced (--respawn, --attach)")
            continue
        out.back_s.append(back[0] - when)
        asked = [j for u, j in joined if u == back[0] and " after an attach from " in j]
        if asked:  # (--attach) rank 0's measure: "started 1.6 s after an attach from ADDRESS asked"
            out.attach_s.append(float(asked[0].split(" started ")[1].split(" s after ")[0]))
            if out.attach_s[-1] > BACK_WITHIN:
                out.failed.append(f"worker rank {w} joined {out.attach_s[-1]:.1f} s after its attach (more than "
                                  f"{BACK_WITHIN:g} s)")
        if back[0] - when > BACK_WITHIN and " after an attach from " not in next(j for u, j in joined if u == back[0]):
            out.failed.append(f"worker rank {w}'s replacement joined {back[0] - when:.1f} s after the loss (more "
                              f"than {BACK_WITHIN:g} s)")
        if not (p["time"][p["worker"] == w] > back[0]).any():
            out.failed.append(f"worker rank {w}'s replacement did not push")
    if got.get("shard_pushes") is None:  # one server
        applied = np.sort(p["version"][p["applied"] == 1])
        if not np.array_equal(applied, np.arange(1, applied.size + 1)):
            out.failed.append(f"the applied pushes' versions are not 1..{applied.size}")
    else:
        check_shards(out, got)
    for w in np.unique(p["worker"]):
        steps = np.sort(p["step"][p["worker"] == w])
        if not np.array_equal(steps, np.arange(1, steps.size + 1)):
            out.failed.append(f"worker rank {w}'s steps are not 1..{steps.size}")
    stop = min((float(r["time"]) for r in events if text(r["kind"]) == "stop"), default=float("inf"))
    late = [t.split()[2] for when, t in lost if when >= stop]  # reported after the STOPs: no one takes its share
    if out.test_count != num_test and not late:
        out.failed.append(f"the final evaluation covered {out.test_count} of {num_test} test images")
    if late:
        out.notes.append(f"rank {', '.join(late)} reported dead after the stop: the final evaluation covered "
                         f"{out.test_count} of {num_test} test images")


def check_shards(out: Outcome, got: dict) -> None:
    """(--servers S > 1) Every shard applied versions 1..V once each, the same V and the same (worker, step)
    pushes on every shard (a dead worker's push counted where it did not arrive: the "lost_push" events)."""
    rows = got["shard_pushes"]
    versions = [int(v) for v in got.get("shard_versions", [])]
    sets = []
    for s in sorted(set(rows["shard"].tolist())):
        mine = rows[(rows["shard"] == s) & (rows["applied"] == 1)]
        v = np.sort(mine["version"])
        if not np.array_equal(v, np.arange(1, v.size + 1)) or (versions and v.size != versions[s]):
            out.failed.append(f"shard {s}'s applied versions are not 1..{versions[s] if versions else v.size}")
        sets.append(sorted(mine[["worker", "step"]].tolist()))
    if any(x != sets[0] for x in sets):
        out.failed.append("the shards applied different pushes")
    if len(set(versions)) > 1:
        out.failed.append(f"the shards end at versions {versions}")
    counted = sum(text(r["kind"]) == "lost_push" for r in got["events"])
    if counted:
        out.notes.append(f"{counted} push(es) of a dead worker counted by rank 0 (they reached another shard only)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs with kills")
    parser.add_argument("--kills", type=lambda t: distinct_ints(t, 1, "1,2,3"), default=[1, 2, 3],
                        help="workers killed per run, in turn (each below --workers)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mode", choices=("async", "ssp", "easgd"), default="async")
    parser.add_argument("--servers", type=int, default=1, help="parameter-server shards")
    parser.add_argument("--respawn", action="store_true", help="train --respawn: each killed worker is replaced; "
                        f"checks that the replacement joins within {BACK_WITHIN:g} s and pushes")
    parser.add_argument("--attach", action="store_true", help="train --attach: once rank 0 logged each loss, "
                        f"`mpiasgd attach` brings the rank back; checks that it joins within {BACK_WITHIN:g} s of "
                        "the attach and pushes")
    parser.add_argument("--model", default="digits")
    parser.add_argument("--epochs", type=float, default=100.0)
    parser.add_argument("--reference", type=int, default=5, help="undisturbed runs (the noise, the time T)")
    parser.add_argument("--seed", type=int, default=0, help="of the victims and kill times")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--keep", default=None, help="a folder to keep every job's run log and output in "
                        "(default: a temporary one, removed at the end)")
    parser.add_argument("--dry-run", action="store_true",
                        help="1 reference run, 1 run with 1 kill, 20 epochs (300 with --attach)")
    args = parser.parse_args(argv)
    if args.dry_run:
        # (--attach: long enough for the attach command to start and the worker to join before the end)
        args.runs, args.kills, args.reference, args.epochs = 1, [1], 1, 300.0 if args.attach else 20.0
    if max(args.kills) >= args.workers:
        parser.error(f"--kills {max(args.kills)}: at least one of the {args.workers} workers must live")
    if (args.respawn or args.attach) and (args.servers > 1 or args.mode == "easgd"):
        parser.error("--respawn, --attach: async or ssp with one server (--servers 1)")
    if args.respawn and args.attach:
        parser.error("--respawn or --attach, not both (each measures its own joins)")
    if args.runs < 1 or args.reference < 1 or args.servers < 1:
        parser.error("--runs, --reference and --servers: expected at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mpiasgd.data import load_dataset
    data = load_dataset(args.model)
    num_train, num_test = data.num_train, data.num_test
    print(f"{args.workers} {args.mode} workers, {args.servers} parameter-server shard(s), {args.model}, "
          f"{args.epochs:g} epochs, under ULFM ({' '.join(FT)}){', --respawn' if args.respawn else ''}"
          f"{', --attach' if args.attach else ''}", flush=True)
    with tempfile.TemporaryDirectory(prefix="elastic-") as name:
        tmp = Path(args.keep or name)
        tmp.mkdir(parents=True, exist_ok=True)
        refs = [job(args, tmp, s, [], [], num_train, num_test) for s in range(args.reference)]
        for r in refs:
            print(f"undisturbed seed {r.seed}: {100 * r.accuracy:.2f} %, {r.seconds:.1f} s"
                  f"{'; ' + '; '.join(r.notes) if r.notes else ''}"
                  f"{'; FAILED: ' + '; '.join(r.failed) if r.failed else ''}", flush=True)
        accs = [r.accuracy for r in refs if r.started and not r.failed] or [float("nan")]  # (the noise: sound runs)
        mean = statistics.fmean(accs)
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        print(f"undisturbed: {100 * mean:.2f} % mean, {100 * sd:.2f} points sd, "
              f"{statistics.median(r.train_s for r in refs):.1f} s from the first push to the end (median)", flush=True)
        runs = []
        for i in range(args.runs):
            rng = np.random.default_rng([args.seed, i])
            k = args.kills[i % len(args.kills)]
            victims = sorted(int(v) for v in rng.choice(np.arange(1, args.workers + 1), k, replace=False))
            # (--attach: by half the run, so that the attach command, a Python start-up on a busy node, comes first)
            times = [float(t) for t in rng.uniform(0.1, 0.5 if args.attach else 0.7, k) * args.epochs]
            r = job(args, tmp, 100 + i, victims, times, num_train, num_test)
            runs.append(r)
            z = (r.accuracy - mean) / sd if sd > 0 else float("nan")
            print(f"run {i + 1:>2} (seed {r.seed}): killed {victims} at epoch "
                  f"{', '.join(f'{t:.1f}' for t in times)}: {r.status}, test {100 * r.accuracy:.2f} % on "
                  f"{r.test_count} images ({z:+.1f} sd), {r.seconds:.1f} s"
                  f"{'; ' + '; '.join(r.notes) if r.notes else ''}"
                  f"{'; FAILED: ' + '; '.join(r.failed) if r.failed else ''}", flush=True)
    print("\n| workers killed | runs | did not start | completed, checks passed | test accuracy, mean (min) | "
          "vs undisturbed |")
    print("|---:|---:|---:|---:|---|---|")
    for k in [0, *args.kills]:
        mine = refs if k == 0 else [r for r in runs if len(r.victims) == k]
        ran = [r for r in mine if r.started]
        if not mine:
            continue
        acc = [r.accuracy for r in ran if math.isfinite(r.accuracy)] or [float("nan")]
        worst = min(((a - mean) / sd for a in acc), default=float("nan")) if sd > 0 else float("nan")
        versus = (f"sd {100 * sd:.2f} points" if k == 0 else
                  f"{100 * (statistics.fmean(acc) - mean):+.2f} points mean, worst {worst:+.1f} sd")
        print(f"| {k} | {len(mine)} | {len(mine) - len(ran)} | {sum(not r.failed for r in ran)} of {len(ran)} | "
              f"{100 * statistics.fmean(acc):.2f} ({100 * min(acc):.2f}) % | {versus} |")
    back = [b for r in runs for b in r.back_s]
    if args.respawn and back:
        print(f"\n--respawn: {len(back)} replacements joined {statistics.median(back):.1f} s after the loss (median), "
              f"{max(back):.1f} s at most (limit {BACK_WITHIN:g} s)", end="")
    asked = [b for r in runs for b in r.attach_s]
    if args.attach and asked:
        print(f"\n--attach: {len(asked)} worker{'s' * (len(asked) != 1)} brought back by `mpiasgd attach` joined "
              f"{statistics.median(asked):.1f} s after the attach (median, rank 0's measure), {max(asked):.1f} s at "
              f"most (limit {BACK_WITHIN:g} s); {statistics.median(back):.1f} s from the loss to the join (median, "
              "the attach command's start-up included)", end="")
    unstarted = [r for r in refs + runs if not r.started]
    restarted = [r for r in refs + runs if r.restarted]
    if restarted:
        print(f"\n{len(restarted)} of {len(refs) + len(runs)} jobs were started again: a rank crashed in MPI_Init "
              "(Open MPI under ULFM; docs/training.md, workers that die)", end="")
    bad = [r for r in refs + runs if r.failed and r.started]
    print()
    if unstarted:
        print(f"{len(unstarted)} of {len(refs) + len(runs)} jobs did not start in {STARTS} attempts")
    print(f"{len(bad)} of the {len(refs) + len(runs) - len(unstarted)} jobs that started failed a check" if bad else
          f"every job that started completed and passed its checks ({len(refs) + len(runs) - len(unstarted)})")
    return 1 if bad or unstarted else 0


if __name__ == "__main__":
    sys.exit(main())
