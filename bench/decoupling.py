#!/usr/bin/env python3
"""The decoupling table at reduced scale, FDG's protocol (Zhuang et al., arXiv 1906.09108): ResNet-20 on
CIFAR-10, plain backpropagation (K = 1) against fully decoupled pipelines of K = 2 and 3 modules with and
without gradient shrinking, each delayed-gradient row under both activation semantics, the same epochs for
every row. One markdown table and the goal line "K = 2 within 1.5 points of K = 1".

    python bench/decoupling.py                                    # 11 rows x 10 epochs: 12-25 h on 2 cores
    python bench/decoupling.py --rows K1,K2-b1-store --epochs 5   # a selection
    python bench/decoupling.py --epochs 0.05 --subset 3           # a smoke run: 3 minibatches a row, ~8 min

Rows (`--rows`, comma-separated, run in the order given; default all; one replica, N = 1: 1 + K ranks):

    K1                   --modules 1                      backpropagation (exactly --mode sync, 1 worker)
    K2-b1-recompute      --modules 2 --cuts 7             module 1 from res5 on, no shrinking
    K2-b1-store          ... --pipeline-activations store
    K2-b0.5-recompute    --modules 2 --cuts 7 --shrink 0.5
    K2-b0.5-store
    K3-b0.5-recompute    --modules 3 --cuts 6,9 --shrink 0.5
    K3-b0.5-store
    K2-b1-store-pred     ... --weight-prediction           (SpecTrain's weight prediction; also b0.75, b0.5, K3)

Cuts are FDG's for ResNet-20 (DG_models.py of github.com/ZHUANGHP/FDG, `args.model == 'ResNet20'`):
K = 2: [conv1 bn1 relu layer1 layer2[:1]] [layer2[1:] layer3 avgpool linear], i.e. modules start at our
res1 and res5 (top-level layers 0 and 7: conv1 bn1 relu1 res1..res9 gap1 fc1); K = 3: one stage each,
[conv1 bn1 relu layer1] [layer2] [layer3 avgpool linear], modules at res1, res4, res7 (0, 6, 9).
`--pipeline-activations`: recompute keeps each module's input and re-runs its forward on the current weights
before the delayed backward; store keeps the forward's activations, as FDG does. If this mpiasgd has no such
option (`python -m mpiasgd train --help`), recompute rows run without it (its only behaviour) and store
rows are skipped with a note.

Hyperparameters: FDG's lr 0.1, momentum 0.9, weight decay 5e-4, batch 128, no warm-up; cosine to 0 over the
run instead of FDG's steps at 150/225/275 of 300 epochs (`--lr-schedule step --lr-milestones ...` for theirs).
Each row is `mpiexec -n 1+K python -m mpiasgd train --model resnet20 --mode pipeline ...` into
RUN_DIR/ROW.h5 (default RUN_DIR runs/decoupling-TIMESTAMP); rank 0 evaluates the final weights on all
10,000 test images. Time per epoch on a machine with fewer cores than ranks (K = 3 on 2 cores) measures
oversubscription, not the method.

Timing on 2 CPU cores (batch 128): K = 1 is the sync run of bench/resnet20_torch.py, 1-2 s per minibatch
(3,907 of them in 10 epochs: 1.1-2.2 h). K = 2 gives each module one core: module 1 (res5 on) has 55 % of
the forward work, so a store row takes about as long as K = 1; recompute re-runs module 0's forward (45 %),
which makes module 0 the slower one by about 10 %. K = 3's 4 ranks share the 2 cores, again about K = 1's
time. (mpiasgd's own FLOP-balanced cuts are FDG's here: 7 and 6,9.) 11 rows: about 12-25 h, plus a minute of
start-up and evaluation each. Every command has a time limit (--timeout); a row that fails is reported in
the table and the script goes on, with exit status 1 at the end. Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

from launch import launcher, run, seconds
from trainrun import cores, epochs_type, name_list, nonnegative

from mpiasgd.argtypes import positive

MODEL = "resnet20"
GOAL_POINTS = 1.5  # K = 2 rows at most this many points below K = 1
# FDG's module starts for ResNet-20 (DG_models.py), as our top-level layer names: module k begins at START[K][k]
FDG_STARTS = {1: ("conv1",), 2: ("conv1", "res5"), 3: ("conv1", "res4", "res7")}


@dataclass(frozen=True)
class RowSpec:
    """A configuration of the table: K modules, shrinking beta, activation semantics ("" for K = 1), and
    whether the modules predict the weights their gradient meets (`--weight-prediction`)."""

    name: str
    modules: int
    beta: float
    activations: str
    prediction: bool = False


ROWS = {row.name: row for row in (
    RowSpec("K1", 1, 1.0, ""),
    RowSpec("K2-b1-recompute", 2, 1.0, "recompute"), RowSpec("K2-b1-store", 2, 1.0, "store"),
    RowSpec("K2-b0.5-recompute", 2, 0.5, "recompute"), RowSpec("K2-b0.5-store", 2, 0.5, "store"),
    RowSpec("K3-b0.5-recompute", 3, 0.5, "recompute"), RowSpec("K3-b0.5-store", 3, 0.5, "store"),
    RowSpec("K2-b1-store-pred", 2, 1.0, "store", True), RowSpec("K2-b0.75-store-pred", 2, 0.75, "store", True),
    RowSpec("K2-b0.5-store-pred", 2, 0.5, "store", True),
    RowSpec("K3-b0.5-store-pred", 3, 0.5, "store", True),
)}


row_list = name_list(ROWS, allow_all=True)  # argparse type: comma-separated row names, or all


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    work = parser.add_argument_group("workload (the same for every row)")
    work.add_argument("--epochs", type=epochs_type, default=10.0, help="passes over the training set per row")
    work.add_argument("--batch-size", type=positive, default=128, help="minibatch, images")
    work.add_argument("--lr", type=nonnegative, default=0.1, help="peak learning rate")
    work.add_argument("--momentum", type=nonnegative, default=0.9, help="SGD momentum")
    work.add_argument("--weight-decay", type=nonnegative, default=5e-4, help="L2 penalty (FDG: 5e-4)")
    work.add_argument("--warmup-epochs", type=nonnegative, default=0.0, help="linear warm-up, epochs (FDG: none)")
    work.add_argument("--lr-schedule", choices=("cosine", "step", "constant"), default="cosine", help="after warm-up")
    work.add_argument("--lr-milestones", default="", metavar="E1,E2", help="step schedule: epochs where lr x 0.1")
    work.add_argument("--seed", type=int, default=0, help="initial weights, shard order and augmentation")
    work.add_argument("--backend", default="auto", help="mpiasgd's --backend: auto | numpy | cpu | cupy")
    work.add_argument("--data-dir", default=None, help="CIFAR-10 folder (None: $MPIASGD_DATA, else ~/.cache/mpiasgd)")
    work.add_argument("--subset", type=positive, default=None, metavar="N",
                      help="smoke run: stop every row after N minibatches (--max-pushes N)")
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--rows", type=row_list, default=list(ROWS), metavar="R1,R2,...",
                       help=f"which rows, in order: {', '.join(ROWS)}, or all")
    bench.add_argument("--json", default=None, metavar="OUT", help="also write the results to this JSON file")
    bench.add_argument("--run-dir", default=None, help="folder of the run logs (None: runs/decoupling-TIMESTAMP)")
    bench.add_argument("--timeout", type=seconds, default=86400.0, help="time limit of each run, seconds")
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir or os.path.join("runs", f"decoupling-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


def fdg_cuts(names: list[str], modules: int) -> str:
    """The --cuts of FDG's ResNet-20 split into `modules` modules: the top-level indices (in `names`, the
    model's layer names) where modules 1..K-1 start, comma-separated ("" for K = 1). KeyError for a K FDG
    does not split ResNet-20 into; ValueError if a layer is missing."""
    starts = FDG_STARTS[modules]
    return ",".join(str(names.index(name)) for name in starts[1:])


def has_activations_option(help_text: str) -> bool:
    """Whether `mpiasgd train --help` lists --pipeline-activations."""
    return "--pipeline-activations" in help_text


def train_command(mpiexec: list[str], row: RowSpec, args: argparse.Namespace, cuts: str,
                  activations_flag: bool) -> list[str]:
    """`mpiexec -n 1+K python -m mpiasgd train ...` of one row; `activations_flag` False leaves out
    --pipeline-activations (an mpiasgd without it)."""
    lr_options = ["--lr-milestones", args.lr_milestones] if args.lr_milestones else []
    return [*mpiexec, "-n", str(1 + row.modules), sys.executable, "-m", "mpiasgd", "train",
            "--model", MODEL, *(["--data-dir", args.data_dir] if args.data_dir else []), "--backend", args.backend,
            "--mode", "pipeline", "--modules", str(row.modules), *(["--cuts", cuts] if cuts else []),
            "--shrink", f"{row.beta:g}", *(["--weight-prediction"] if row.prediction else []),
            *(["--pipeline-activations", row.activations] if row.activations and activations_flag else []),
            "--epochs", f"{args.epochs:g}", *(["--max-pushes", str(args.subset)] if args.subset else []),
            "--batch-size", str(args.batch_size), "--lr", f"{args.lr:g}", "--momentum", f"{args.momentum:g}",
            "--weight-decay", f"{args.weight_decay:g}", "--warmup-epochs", f"{args.warmup_epochs:g}",
            "--lr-schedule", args.lr_schedule, *lr_options, "--seed", str(args.seed),
            "--snapshot-interval", "0", "--checkpoint-interval", "0", "--no-progress",
            "--run-dir", args.run_dir, "--name", row.name]


@dataclass
class RowResult:
    """A row of the table: its configuration and what its run log says (None where it did not run)."""

    name: str
    modules: int
    beta: float
    activations: str
    cuts: str
    test_accuracy: float | None = None
    s_per_epoch: float | None = None
    images_per_s: float | None = None
    epochs: float | None = None
    note: str = ""


def gap_points(row: RowResult, base: RowResult | None) -> float | None:
    """The row's test accuracy minus K = 1's, in points (None without either)."""
    if base is None or base.test_accuracy is None or row.test_accuracy is None:
        return None
    return 100 * (row.test_accuracy - base.test_accuracy)


def table_lines(rows: list[RowResult]) -> list[str]:
    """The markdown table: row, K, beta, activations, cuts, test accuracy, s per epoch, images/s, gap to K = 1."""
    base = next((r for r in rows if r.modules == 1 and r.test_accuracy is not None), None)
    lines = ["| row | K | beta | activations | cuts | test accuracy | s per epoch | images/s | gap to K=1 (points) |",
             "| :-- | -: | ---: | :---------- | :--- | ------------: | ----------: | -------: | ------------------: |"]
    for r in rows:
        if r.test_accuracy is None:
            lines.append(f"| {r.name} | {r.modules} | {r.beta:g} | {r.activations or '-'} | {r.cuts or '-'} | "
                         f"{r.note or 'not run'} | | | |")
            continue
        gap = gap_points(r, base)
        lines.append(f"| {r.name} | {r.modules} | {r.beta:g} | {r.activations or '-'} | {r.cuts or '-'} | "
                     f"{100 * r.test_accuracy:.2f}% | {r.s_per_epoch:,.0f} | {r.images_per_s:,.1f} | "
                     f"{'-' if gap is None or r is base else f'{gap:+.2f}'} |")
    return lines


def goal_line(rows: list[RowResult]) -> str:
    """"K = 2 within 1.5 points of K = 1: yes/no": every K = 2 row that ran at most 1.5 points below K = 1
    (above it counts as within), naming the worst; "not assessed" without K = 1 or a K = 2 row."""
    goal = f"K = 2 within {GOAL_POINTS:g} points of K = 1"
    base = next((r for r in rows if r.modules == 1 and r.test_accuracy is not None), None)
    twos = [(gap_points(r, base), r.name) for r in rows if r.modules == 2 and r.test_accuracy is not None]
    if base is None or not twos:
        return f"{goal}: not assessed (no {'K = 1' if base is None else 'K = 2'} row ran)"
    worst, name = min(twos)
    return (f"{goal}: {'yes' if worst >= -GOAL_POINTS else 'no'} (worst K = 2 row: {name}, {worst:+.2f} points; "
            f"{len(twos)} K = 2 row{'s' * (len(twos) != 1)})")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mpiasgd.model import build_model
    from mpiasgd.runlog import load

    names = build_model(MODEL).names
    mpiexec = launcher()
    helped = run([sys.executable, "-m", "mpiasgd", "train", "--help"], 120.0)
    activations_flag = has_activations_option(helped.stdout)
    if not activations_flag:
        print("note: this mpiasgd has no --pipeline-activations: recompute rows run without it (its only "
              "behaviour), store rows are skipped", flush=True)
    if args.subset:
        print(f"SUBSET: every row stops after {args.subset} minibatches ({args.subset * args.batch_size:,} images): a "
              f"smoke run, its accuracies say nothing", flush=True)
    commands, rows, failed = [], [], False
    for i, name in enumerate(args.rows, 1):
        spec = ROWS[name]
        cuts = fdg_cuts(names, spec.modules)
        row = RowResult(name, spec.modules, spec.beta, spec.activations, cuts)
        rows.append(row)
        if spec.activations == "store" and not activations_flag:
            row.note = "skipped: no --pipeline-activations"
            continue
        cmd = train_command(mpiexec, spec, args, cuts, activations_flag)
        commands.append(cmd)
        print(f"[{i}/{len(args.rows)}] {name}: training ...", end=" ", flush=True)
        done = run(cmd, args.timeout)
        print(f"{done.seconds:.0f} s" if done.ok else "FAILED", flush=True)
        log = load(os.path.join(args.run_dir, name + ".h5")) if done.ok else None
        if log is None or log.get("status") != "completed":
            print(done.explain(args.timeout) if not done.ok else f"run log status {log.get('status')!r}",
                  file=sys.stderr, flush=True)
            row.note, failed = "FAILED (see stderr)", True
            continue
        row.epochs = float(log["epochs_done"])
        row.test_accuracy = float(log["test_accuracy"])
        row.s_per_epoch = float(log["train_time_s"]) / row.epochs
        row.images_per_s = float(log["images_per_s"])
        print(f"    test accuracy {100 * row.test_accuracy:.2f} %, {row.s_per_epoch:,.0f} s per epoch", flush=True)
    goal = goal_line(rows)
    print(f"\nResNet-20 on CIFAR-10, {args.epochs:g} epochs per row"
          + (f" (SUBSET: {args.subset} minibatches only)" if args.subset else "")
          + f", batch {args.batch_size}, lr {args.lr:g} {args.lr_schedule}, momentum {args.momentum:g}, weight decay "
          f"{args.weight_decay:g}, warm-up {args.warmup_epochs:g}, seed {args.seed}; --mode pipeline, one replica "
          f"(1 + K ranks), fully decoupled, FDG's cuts; {cores()} cores, {time.strftime('%Y-%m-%d')}.\n")
    print("\n".join(table_lines(rows)))
    print(f"\n{goal}")
    print("\nCommands (`python bench/decoupling.py " + shlex.join(sys.argv[1:] if argv is None else argv)
          + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "subset": bool(args.subset),
               "activations_option": activations_flag, "cores": cores(), "date": time.strftime("%Y-%m-%d"),
               "rows": [asdict(r) for r in rows], "goal": goal, "commands": [shlex.join(c) for c in commands]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
