"""Rank 0 of `mpiasgd train`: create (or continue) the run log, serve, close the log, say how it ended; and
(`serve_shard`, --servers S > 1) the other parameter-server shards, which serve their slices and keep no log.

Exit statuses: 0, EXIT_PREEMPTED (75) when a signal ended the run (the checkpoint is written),
EXIT_DIVERGED (3) when --on-divergence stop ended it; a failed worker or a worker that died ends
the job through MPI_Abort after the log is closed with status "failed", so nothing already logged
is lost.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from tqdm import tqdm

from mpiasgd import signals
from mpiasgd.comms import CommTimeout, Message, Tag, ulfm
from mpiasgd.comms.routed import RoutedComm
from mpiasgd.comms.waits import server_wait
from mpiasgd.config import Config, from_mapping, resume_overrides
from mpiasgd.health import LossWatch
from mpiasgd.model.spec import to_json
from mpiasgd.modes.registry import SERVER_MODES
from mpiasgd.optim import StopRule
from mpiasgd.rank0.attach import Attacher, attach_path, identity
from mpiasgd.rank0.loop import PREEMPT_GRACE, Preempted, Rank0, WorkerFailed, kept_note
from mpiasgd.rank0.recorder import Recorder
from mpiasgd.rank0.respawn import Respawner, kill_here, room_note
from mpiasgd.rank0.shard_hub import HubLink, ShardHub
from mpiasgd.rank0.shard_recorder import ShardRecorder
from mpiasgd.runlog import EventRow, RunLog, RunLogError, summary_lines
from mpiasgd.runlog.startup import ShardInfo, versions
from mpiasgd.runlog.tensorboard import TensorBoard, TensorBoardUnavailable, require, tensorboard_dir

EXIT_DIVERGED = 3  # --on-divergence stop ended the run (log status 'diverged')
EXIT_PREEMPTED = signals.EXIT_PREEMPTED  # 75: checkpointed on a signal; requeue and --resume
ABORT_CODE = 1


def announce(cfg: Config, me: Any, start: Any, workers: list) -> None:
    """The first lines rank 0 prints: workers and their kind, model, dataset, the mode's layout, and (--servers
    S > 1) the shards' cut."""
    from mpiasgd import __version__

    model, dataset = start.model, start.dataset
    kinds: dict[str, int] = {}
    for w in workers:  # e.g. "cupy (pinned) x2" or "numpy (host) x2"
        key = f"{w.backend} ({w.transfer})"
        kinds[key] = kinds.get(key, 0) + 1
    print(f"mpiasgd {__version__}: {me.num_workers} worker{'s' * (me.num_workers != 1)} "
          f"[{', '.join(f'{k} x{n}' for k, n in kinds.items())}], model {cfg.model_label} "
          f"({model.num_params:,} parameters), "
          f"dataset {cfg.dataset_name} ({dataset.train_y.size:,} train / {dataset.test_y.size:,} test images)",
          flush=True)
    if cfg.show_config:
        print(f"resolved config:\n{cfg.describe()}", flush=True)
    lines = start.mode.describe(cfg, model, start.layout, me.num_workers)
    if lines:
        print(lines, flush=True)
    if start.cut is not None:
        print(start.cut.describe(me.num_workers), flush=True)


def server_wait_of(cfg: Config, me: Any) -> tuple[str, str]:
    """(how this server rank waits for its next message, "spin" | "backoff"; the start-up line that says so and
    why, "" where there is nothing to say): --server-wait resolved for the ranks and cores of its node
    (`mpiasgd.comms.waits.server_wait`; `me.node_ranks`, `me.node_cores`). The rank 0 of sync and pipeline,
    which only logs, backs off as before."""
    if cfg.mode not in SERVER_MODES:
        return "backoff", ""
    choice, why = server_wait(cfg.server_wait, me.node_ranks, me.node_cores)
    doing = "spins on its requests (no sleep between polls)" if choice == "spin" else \
        "sleeps between polls of its requests (backoff, 10 us to 2 ms)"
    shards = "; each other shard decides for its own node" if cfg.servers > 1 and cfg.server_wait == "auto" else ""
    return choice, f"the parameter server {doing}: {why}{shards}"


def start_log(cfg: Config, me: Any, start: Any, workers: list, extra: dict | None = None,
              shards: list | None = None) -> RunLog:
    """Create the run log, or (resuming) continue it (a new one when it is missing, or `start.replace_log`:
    --overwrite of one that cannot be read); logs the resume's config changes and autotune events.
    `extra`: more attributes of a new log (`mpiasgd simulate`: that it is simulated, and how). `shards`
    (--servers S > 1): the other shards' ShardInfo records; the cut and their processes become attributes."""
    model, dataset, ckpt = start.model, start.dataset, start.checkpoint

    attrs = {"config": cfg.to_json(), "versions": versions(), "layout": model.layout(), "model": cfg.model,
             "model_spec": to_json(model.spec()), "buffer_layout": model.buffer_layout(),
             "mode": cfg.mode, "num_workers": me.num_workers, "num_params": model.num_params,
             "num_buffers": model.num_buffers,
             "num_train": int(dataset.train_y.size), "num_test": int(dataset.test_y.size),
             "data_source": dataset.source, "data_fingerprint": dataset.fingerprint, "command": " ".join(sys.argv),
             **start.layout.attrs, **(extra or {})}
    sharded = {}
    if start.cut is not None:
        sharded = {**start.cut.attrs(), "shard_processes": [[i.rank, i.host, i.pid] for i in shards or []]}
        attrs.update(sharded)
    rows = [w.row() for w in workers]
    if ckpt is not None and os.path.exists(start.path) and not start.replace_log:
        log = RunLog.reopen(start.path, rows, cfg.flush_interval, start.lock, resumed_at=ckpt.log_time,
                            resumed_steps=ckpt.steps())
    else:
        if ckpt is not None:  # the run continues from its checkpoint; its history is gone (or replaced: --overwrite)
            attrs["run_id"] = ckpt.run_id
            why = f"{start.replace_log}; --overwrite replaces it" if start.replace_log else "is missing"
            print(f"mpiasgd: warning: run log '{start.path}' of checkpoint '{ckpt.path}' {why}: a new log "
                  f"starts at the checkpoint (version {ckpt.version})", file=sys.stderr, flush=True)
        log = RunLog.create(start.path, attrs, rows, model.num_params, cfg.flush_interval, start.lock,
                            num_buffers=model.num_buffers)
    if ckpt is not None:
        changed = resume_overrides(from_mapping(json.loads(ckpt.config)), cfg)
        text = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()) or "none"
        log.add(EventRow(time=max(ckpt.log_time, log.last_time()), kind=b"overrides",
                         text=f"resumed with config changes: {text}; command: {' '.join(sys.argv)}"))
        log.file.attrs["config"] = cfg.to_json()
        for key, value in sharded.items():  # this job's shard processes (the cut is the same: fixed on resume)
            log.file.attrs[key] = value if isinstance(value, (str, int, float)) else json.dumps(value)
        epochs = ckpt.samples / dataset.train_y.size
        if StopRule.of(cfg).fraction(epochs, ckpt.version, ckpt.elapsed) >= 1:
            print(f"mpiasgd: warning: checkpoint '{ckpt.path}' already meets the stopping rule (version "
                  f"{ckpt.version}, {epochs:.2f} epochs, {ckpt.elapsed:.1f} s): nothing is trained; raise "
                  f"--epochs, --max-pushes or --max-time to train longer", file=sys.stderr, flush=True)
        print(f"mpiasgd: resuming '{start.path}' from checkpoint '{ckpt.path}' (version {ckpt.version}, "
              f"{ckpt.elapsed:.1f} s of training); config changes: {text}", flush=True)
        if ckpt.num_workers != me.num_workers:
            note = (f"resumed a checkpoint of {ckpt.num_workers} workers with {me.num_workers}: the training set is "
                    f"dealt over {me.num_workers} shards, each worker goes on at the epoch it had reached (a new one "
                    f"at the workers' mean); not bit-identical to a run with one number of workers"
                    + ("; sync: the global batch is now the batch size x the workers, the step size schedule is the "
                       "same" if cfg.mode == "sync" else ""))
            log.add(EventRow(time=max(ckpt.log_time, log.last_time()), kind=b"resume_workers", text=note))
            print(f"mpiasgd: {note}", flush=True)
    at = log.last_time() if ckpt is None else max(ckpt.log_time, log.last_time())  # (reads the file: once)
    for w in workers:  # --conv-algo autotune, --cuda-graphs: what each GPU worker chose (after a resume's events)
        if w.autotune:
            log.add(EventRow(time=at, kind=b"autotune", text=w.autotune_event()))
        if w.graphs:
            log.add(EventRow(time=at, kind=b"cuda_graphs", text=w.graphs_event()))
    return log


def make_recorder(cfg: Config, start: Any, log: RunLog, num_workers: int, kind: type, desc: str = "training") -> Any:
    """Rank 0's recorder of class `kind` (a Recorder) on `log` for `num_workers` workers: with the progress bar
    (--progress, labelled `desc`), the divergence watch of the mode, the network's definition for the
    checkpoints and, with --tensorboard, the event files (a resume hides what the replaced segment wrote after
    its checkpoint). `start` is the Startup (model, dataset, mode, checkpoint, path)."""
    dataset, ckpt = start.dataset, start.checkpoint
    bar = None
    if cfg.progress:
        total = cfg.epochs * dataset.train_y.size if cfg.epochs else None
        total = int(total) if total and total < 2**53 else None  # a huge --epochs: a bar without a total
        bar = tqdm(total=total, unit="img", unit_scale=True, dynamic_ncols=True, mininterval=0.5, desc=desc,
                   file=sys.stderr)
    health = LossWatch(len(dataset.classes), num_workers, asynchronous=start.mode.asynchronous,
                       advice=start.mode.advice)
    rec = kind(cfg, log, range(1, num_workers + 1), dataset.train_y.size, bar, health)
    rec.model_spec = to_json(start.model.spec())
    if cfg.tensorboard:  # RUN_DIR/NAME.tb/
        rec.tensorboard = TensorBoard(tensorboard_dir(start.path), purge_step=None if ckpt is None else ckpt.samples,
                                      warn=rec.warn)
    return rec


def open_attach(r0: Any, path: str, expected: dict[str, str]) -> Attacher | None:
    """(--attach) Rank 0's listener for `mpiasgd attach`, and its attach file beside the run log `path`; None (said
    on stderr and logged, the run goes on without attach) when the port or the file cannot be opened."""
    try:
        return Attacher(r0, path, expected)
    except OSError as e:
        r0.rec.warn(f"--attach: cannot listen for `mpiasgd attach` ({e}): the run goes on without it")
        return None


def serve(cfg: Config, me: Any, start: Any) -> int:
    """(rank 0) Create (or, resuming, continue) the run log, serve, close the log, print the summary.

    Returns 0, EXIT_PREEMPTED when a signal ended the run (the checkpoint is written), or EXIT_DIVERGED when
    --on-divergence stop ended it.
    """
    model, dataset, ckpt = start.model, start.dataset, start.checkpoint
    if cfg.tensorboard:  # before the log exists: an error like those of start-up, the job ends with status 2
        try:
            require()
        except TensorBoardUnavailable as e:
            start.release()
            print(f"mpiasgd: error: {e}", file=sys.stderr, flush=True)
            time.sleep(0.3)  # let the launcher forward the line before the abort tears the job down
            me.comm.Abort(2)
            return 2
    gathered = me.comm.gather(None, root=0)
    workers = gathered[1:me.num_workers + 1]  # each worker's WorkerInfo, in rank order
    shards = gathered[me.num_workers + 1:]    # --servers S > 1: the other shards' ShardInfo
    announce(cfg, me, start, workers)
    log = start_log(cfg, me, start, workers, shards=shards)
    params = model.init_params(cfg.seed)
    rec = make_recorder(cfg, start, log, me.num_workers, Recorder)
    bar = rec.progress
    hosts = {w.rank: w.host for w in [*workers, *shards]}

    wait, note = server_wait_of(cfg, me)
    if note:  # said once, on the console and (when the clocks start) in the log's events
        print(f"mpiasgd: {note}", flush=True)
    notes = [("server_wait", note)] if note else []  # (logged when the clocks start: `Rank0.run`)
    for flag, on in (("--respawn", cfg.respawn), ("--attach", cfg.attach)):
        if on and not ulfm.enabled():
            print(f"mpiasgd: warning: {flag} applies under ULFM only (mpiexec --with-ft ulfm, docs/training.md): "
                  "without it any death ends the job", file=sys.stderr, flush=True)
    if cfg.min_workers != 1 and not ulfm.enabled():
        print(f"mpiasgd: warning: --min-workers {cfg.min_workers} applies under ULFM only (mpiexec --with-ft ulfm, "
              "docs/training.md): without it any death ends the job", file=sys.stderr, flush=True)
    if ulfm.enabled():  # which behaviour applies to a rank's death
        survives = start.mode.elastic
        room = "; " + room_note(me.comm) if cfg.respawn and room_note(me.comm) else ""
        text = ("fault tolerance: ULFM (mpiexec --with-ft ulfm): " +
                (f"a worker that dies is dropped and the run goes on while {cfg.min_workers} or more are left "
                 f"(--min-workers)" + ("; a parameter-server shard that dies ends it" if cfg.servers > 1 else "")
                 + (f"; --respawn: rank 0 starts a replacement for it (MPI_Comm_spawn{room})" if cfg.respawn else "")
                 + (f"; --attach: `mpiasgd attach {attach_path(start.path)}` brings lost ranks back" if cfg.attach
                    else "")
                 if survives else f"mode '{cfg.mode}' does not drop a dead worker yet: a death ends the run "
                 "(status failed; its last checkpoint stands)"))
        if not ulfm.detector_thread():
            text += ("; warning: without --mca mpi_ft_detector true --mca mpi_ft_detector_thread true a death may "
                     "go unseen, or a busy rank be taken for dead")
        print(f"mpiasgd: {text}", flush=True)
        notes.append(("fault_tolerance", text))
    if cfg.server_threads > 1 and cfg.server_threads * cfg.servers > me.node_cores:
        print(f"mpiasgd: warning: --server-threads {cfg.server_threads} x {cfg.servers} server rank(s) is more than "
              f"the {me.node_cores} core(s) of rank 0's node: the threads share cores (and take the workers')",
              file=sys.stderr, flush=True)
    respawn = (cfg.respawn or cfg.attach) and ulfm.enabled()  # (--attach starts its workers as --respawn does)
    r0 = Rank0(RoutedComm(me.comm) if respawn else me.comm, cfg, rec,
               lambda r0: start.mode.rank0(r0, params, model.decay_mult(), model, dataset, start.layout),
               pids={w.rank: (w.host, w.pid) for w in [*workers, *shards]},
               make_link=ShardHub if start.cut is not None else None, server_wait=wait, notes=notes)
    if ckpt is not None:
        rec.restore(ckpt)
        r0.role.restore(ckpt if r0.link is None else r0.link.restore(ckpt))  # (the other shards: their slices)
    start.rank0 = r0  # for `log_unwritable`, should the log fail
    if respawn:
        r0.respawner = Respawner(r0, start.definition, me.size, sys.argv[1:], {w.rank: w for w in workers})
    if respawn and cfg.attach:
        r0.attacher = open_attach(r0, start.path, identity(start.definition, cfg.dataset_name, dataset.fingerprint))
    try:
        try:
            summary = r0.run()
        finally:
            if r0.attacher is not None:  # no attach once the run ends, however it ends
                r0.attacher.close()
        if r0.respawner is not None:  # (--respawn) the replacements finalize MPI once rank 0 disconnects
            r0.respawner.close()
    except (Preempted, WorkerFailed) as stop:
        # close the log first, so nothing already logged is lost, then end the whole job
        if isinstance(stop, WorkerFailed):
            status, code, text = "failed", ABORT_CODE, f"{stop.who} rank {stop.rank} on {hosts[stop.rank]} failed"
        elif stop.dead:  # the launcher's SIGTERM after a worker (or a shard) died
            names = ", ".join(f"{r0.name_of(w)} on {hosts[w]}" for w in stop.waiting)
            status, code = "failed", ABORT_CODE
            how = ("reported by ULFM; the run does not go on without it, as said above" if ulfm.enabled() else
                   "its process exited; the launcher ended the job")
            text = f"{names} died ({how}); {r0.resume_note()}"
        elif stop.evaluating:  # a signal during the final evaluation, which took longer than the grace
            names = ", ".join(f"rank {w} on {hosts[w]}" for w in stop.waiting)
            status, code = "preempted", EXIT_PREEMPTED
            text = (f"{stop.why}; {r0.resume_note()} (a resume evaluates it); worker(s) {names} had not finished "
                    f"the final evaluation within {PREEMPT_GRACE:g} s of the signal: the run ends without it")
        else:  # a signal, and some workers did not answer: hung, or dead on another host
            names = ", ".join(f"rank {w} on {hosts[w]}" for w in stop.waiting)
            status, code = "preempted", EXIT_PREEMPTED
            text = (f"{stop.why}; {r0.resume_note()}; worker(s) {names} did not answer within {PREEMPT_GRACE:g} s: "
                    f"dead (a launcher ends the job with SIGTERM when a rank dies) or hung")
        rec.event(status, f"{text}:\n{stop.text}" if isinstance(stop, WorkerFailed) else text)
        rec.close_tensorboard()  # before the abort below: the event files keep what was logged
        closed = f"run log '{start.path}' closed with status '{status}'"
        try:
            log.close(status)
        except RunLogError as e:  # the disk is full too
            closed = f"{e}; {log.outcome}"
        if isinstance(stop, WorkerFailed):  # the failed worker waits for this acknowledgement before it aborts
            me.comm.Isend(Message(0).stamp(Tag.ERROR_ACK, 0).buf, dest=stop.rank, tag=int(Tag.ERROR_ACK))
        if bar is not None:
            bar.close()
        if isinstance(stop, WorkerFailed) and "\n" not in stop.text:  # a message, not a traceback: one line
            print(f"mpiasgd: {text}: {stop.text}; {closed}.", file=sys.stderr, flush=True)
        else:
            print(f"mpiasgd: {text}; {closed}." + (f"\n{stop.text}" if isinstance(stop, WorkerFailed) else ""),
                  file=sys.stderr, flush=True)
        if isinstance(stop, Preempted) and stop.dead:
            time.sleep(0.3)  # the launcher is tearing the job down: let it forward this message first
        if r0.respawner is not None:  # (--respawn) a replacement stopped by the STOPs finalizes once disconnected
            r0.respawner.close(timeout=2.0)
        ulfm.abort(me.comm, code)
        return code
    except BaseException as e:
        if isinstance(e, RunLogError):
            raise  # the log cannot be written (disk full): `train` reports it in one line (`log_unwritable`)
        if isinstance(e, CommTimeout) and r0.role.checkpoints_here and r0.link is None:
            if rec.write_checkpoint(r0.role.state("failure")):  # a hung worker: the state on rank 0 is sound
                print(f"mpiasgd: checkpoint '{rec.checkpoint_path}' written at the failure (version {rec.version}); "
                      f"continue with --resume {rec.checkpoint_path}", file=sys.stderr, flush=True)
        elif isinstance(e, CommTimeout) and r0.role.checkpoints_here:  # --servers S > 1
            rec.warn(f"no checkpoint written at the failure: {SHARDS_NOT_ONE_CUT}; " + kept_note(rec.checkpoint_path))
        rec.event("failed", traceback.format_exc())
        try:
            log.close("failed")
        except RunLogError as closing:  # the disk is full too: say so; the traceback of `e` follows
            print(f"mpiasgd: error: rank 0: {closing}; {log.outcome}", file=sys.stderr, flush=True)
        raise
    finally:
        rec.close_tensorboard()
        if bar is not None:
            bar.close()
    if r0.preempted:
        if rec.checkpoint_error:  # nothing to requeue from: not the status that says "try again"
            text = f"run preempted ({r0.preempted}) but its {rec.checkpoint_error}"
            rec.event("failed", text)
            log.close("failed", summary)  # not "preempted": there is no checkpoint of this state to resume from
            print(f"mpiasgd: error: {text}", file=sys.stderr, flush=True)
            ulfm.abort(me.comm, ABORT_CODE)
            return ABORT_CODE
        log.close("preempted", summary)
        print(f"mpiasgd: run preempted ({r0.preempted}); checkpoint '{rec.checkpoint_path}' written at "
              f"version {summary['version']}; continue with --resume {rec.checkpoint_path}", file=sys.stderr,
              flush=True)
        return EXIT_PREEMPTED
    if rec.diverged:  # --on-divergence stop: the run ended early, evaluated, with status 'diverged'
        log.close("diverged", summary)
        print("\n".join(summary_lines(start.path)), flush=True)
        print(f"mpiasgd: error: run stopped (--on-divergence stop): {rec.diverged}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    log.close("completed", summary)
    print("\n".join(summary_lines(start.path)), flush=True)
    end_dropped(r0.dropped)
    return 0


def end_dropped(dropped: list[tuple[int, str, int]]) -> None:
    """(ULFM, the run ended) Workers dropped as dead that still live on this node (a stopped one, SIGSTOP: ULFM
    declares it dead, yet mpiexec would wait for it for ever) get SIGKILL, once their command line shows they are
    ours; on another node they are left to the launcher. `dropped`: (worker rank, host, pid) of each process
    dropped (`Rank0.dropped`: with --respawn a replacement may hold the rank now, the dropped process stays
    listed)."""
    for w, host, pid in dropped:
        if not kill_here(host, pid):  # gone already, elsewhere, or not ours to signal
            continue
        print(f"mpiasgd: worker rank {w} (pid {pid}) was dropped as dead but still lives (stopped?): killed, so that "
              "the job can end", file=sys.stderr, flush=True)


SHARDS_NOT_ONE_CUT = ("with --servers the shards' slices are one consistent state only when they agree on the "
                      "pushes each applies (an interval, signal or end checkpoint), which a failure does not allow")


def log_unwritable(me: Any, start: Any, error: RunLogError) -> None:
    """(rank 0) The run log cannot be written (disk full, quota, I/O error): print one error line naming
    the file and the cause, end the log as far as the disk allows (`RunLog.abandon`: status "failed";
    readable up to its last flush either way) and release its lock, write a checkpoint where rank 0
    holds the state (one line says whether it was written), then abort the whole job: the workers end
    with it."""
    r0 = getattr(start, "rank0", None)
    try:
        if r0 is None:  # the log could not even be created or reopened: there is nothing to close
            start.release()
            print(f"mpiasgd: error: rank 0: {error}", file=sys.stderr, flush=True)
            return
        rec = r0.rec
        print(f"mpiasgd: error: rank 0: {error}; {rec.log.abandon()}", file=sys.stderr, flush=True)
        path = rec.checkpoint_path
        if rec.log.taken_over:  # a job of this run started while it was ending (on a signal): the files are its
            print(f"mpiasgd: no checkpoint written now: another job continues this run; '{path}' is left to it",
                  file=sys.stderr, flush=True)
            return
        if r0.role.checkpoints_here and r0.link is not None:  # --servers S > 1
            print(f"mpiasgd: no checkpoint written now: {SHARDS_NOT_ONE_CUT}; {kept_note(path)}", file=sys.stderr,
                  flush=True)
        elif r0.role.checkpoints_here:
            if rec.write_checkpoint(r0.role.state("failure")):  # a failed write prints its own warning line
                print(f"mpiasgd: checkpoint '{path}' written (version {rec.version}); once there is space, "
                      f"continue with --resume {path}", file=sys.stderr, flush=True)
        else:
            kept = (f"the last one, '{path}', is kept: continue from it with --resume" if os.path.isfile(path)
                    else "there is none to resume from")
            print(f"mpiasgd: no checkpoint written now (the state is on the workers); {kept}", file=sys.stderr,
                  flush=True)
    finally:
        time.sleep(0.3)  # let the launcher forward these lines before the abort tears the job down
        ulfm.abort(me.comm, ABORT_CODE)


def serve_shard(cfg: Config, me: Any, start: Any) -> int:
    """(a parameter-server shard of rank >= 1, --servers S > 1) Join the start-up gather (a ShardInfo), take
    rank 0's RESTORE when resuming, then serve this shard's slice with the mode's server in rank 0's loop,
    linked to rank 0 (`mpiasgd.rank0.shard_hub.HubLink`), until rank 0 says END. Returns 0, or EXIT_PREEMPTED
    when a signal ended the run. Raises what the loop raises (the caller reports it to rank 0)."""
    shard = start.cut.shard_of(me.rank, me.num_workers)
    me.comm.gather(ShardInfo(rank=me.rank, shard=shard, host=me.host, pid=os.getpid()), root=0)
    model, dataset = start.model, start.dataset
    params = model.init_params(cfg.seed)  # rank 0's seed: the same initial weights; its slice is this shard's
    rec = ShardRecorder(cfg, range(1, me.num_workers + 1), dataset.train_y.size, shard, me.rank)
    r0 = Rank0(me.comm, cfg, rec, lambda r0: start.mode.rank0(r0, params, model.decay_mult(), model, dataset,
                                                              start.layout), make_link=HubLink,
               server_wait=server_wait_of(cfg, me)[0])
    r0.role.periodic.on = False  # rank 0 asks for the evaluations during training
    if cfg.resume:
        r0.link.restore()
    r0.run()
    return EXIT_PREEMPTED if r0.link.preempted else 0
