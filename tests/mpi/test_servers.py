"""Parameter-server shards (`--servers S`) under `mpiexec`: N workers + S shards (rank 0 and ranks N+1..N+S-1).
Each job runs under a timeout (a hang fails the test); the checks read the run log and the checkpoint. The
shards' arithmetic is checked in-process in tests/unit/test_sharded_server.py (S shards end with one server's
weights, bit for bit).
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from kit.launch import run_mpi, start_mpi, stop_group
from kit.runs import FAST, read_log, wait_for_pushes

from mpiasgd import checkpoint
from mpiasgd.comms.protocol import HEADER_BYTES, message_bytes
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.model import build_model
from mpiasgd.runlog import load

WORKERS, SERVERS = 2, 2
RANKS = WORKERS + SERVERS
SHARD_RANK = WORKERS + 1  # shard 1
PREEMPTED = 75


def shard_rows(t, s):
    rows = t["shard_pushes"]
    return rows[rows["shard"] == s]


def check_shards(attrs, t, model="digits", resumed_from=None, jobs=1):
    """What every sharded run's log holds: the cut, each shard's rows (consecutive versions from 1, or from the
    checkpoint's `resumed_from` versions), final versions equal to the pushes each applied, each shard's
    staleness over all its rows (every segment of a resumed run), each shard's bytes (every PUSH its rows
    record; a reply to each, the initial weights of each of the `jobs` jobs and at most one STOP per worker
    answering a FINISH) and the run's bytes their sum."""
    net = build_model(model)
    cut = ShardCut.balanced(net.num_params, net.num_buffers, SERVERS)
    assert attrs["servers"] == SERVERS
    assert json.loads(attrs["shard_bounds"]) == list(cut.bounds)
    assert json.loads(attrs["shard_params"]) == [cut.size(s) for s in range(SERVERS)]
    assert [r for r, _, _ in json.loads(attrs["shard_processes"])] == [SHARD_RANK]
    versions = list(attrs["shard_versions"])
    assert versions[0] == attrs["version"]
    for s in range(SERVERS):
        rows = shard_rows(t, s)
        applied = rows[rows["applied"] == 1]
        first = 0 if resumed_from is None else int(resumed_from[s])
        assert len(applied) > 0 and sorted(set(rows["worker"].tolist())) == list(range(1, WORKERS + 1))
        if resumed_from is None:  # a resumed log also holds the first segment's rows
            assert applied["version"].tolist() == list(range(first + 1, versions[s] + 1))
        assert (applied["staleness"] == applied["version"] - 1 - applied["base_version"]).all()
        assert applied["staleness"].min() >= 0
        assert attrs["shard_staleness_max"][s] == applied["staleness"].max()
        assert attrs["shard_staleness_mean"][s] == pytest.approx(applied["staleness"].mean())
        size = message_bytes(cut.count(s), json.loads(attrs["config"])["wire"])
        assert attrs["shard_wire_bytes_pushed"][s] == len(rows) * size
        pulled, left = divmod(int(attrs["shard_wire_bytes_pulled"][s]), size)
        assert left == 0 and len(rows) + jobs * WORKERS <= pulled <= len(rows) + jobs * 2 * WORKERS
        for w in range(1, WORKERS + 1):  # every shard saw every push of every worker, in step order
            steps = rows["step"][rows["worker"] == w].tolist()
            assert steps == list(range(steps[0], steps[0] + len(steps)))
    # the stop's agreement: every shard applies the same pushes, whichever shard a push in flight reached first
    assert versions[1] == versions[0]
    if resumed_from is None:
        pairs = [sorted(map(tuple, shard_rows(t, s)[shard_rows(t, s)["applied"] == 1][["worker", "step"]].tolist()))
                 for s in range(SERVERS)]
        assert pairs[0] == pairs[1]
    for kind in ("pushed", "pulled"):
        assert attrs[f"wire_bytes_{kind}"] == sum(attrs[f"shard_wire_bytes_{kind}"])
    return versions


def check_continued(t, first, versions):
    """After a resume from checkpoint `first`, every shard counts on from its checkpointed version up to its final
    one in `versions`, and every worker's steps (exchanges) continue from 1 without a gap."""
    resume = float(t["events"]["time"][t["events"]["kind"] == b"resume"][0])
    for s in range(SERVERS):
        rows = shard_rows(t, s)
        later = rows[(rows["time"] >= resume) & (rows["applied"] == 1)]
        assert later["version"].tolist() == list(range(int(first.shard_versions[s]) + 1, versions[s] + 1))
    for w in (1, 2):
        steps = t["pushes"]["step"][t["pushes"]["worker"] == w].tolist()
        assert steps == list(range(1, len(steps) + 1)), steps


def test_two_shards_train_digits(mpirun, tmp_path):
    res = mpirun(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "3", "--name", "s"], timeout=180)
    assert res.returncode == 0, res.explain()
    assert f"shard 1 (rank {SHARD_RANK})" in res.stdout, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "s.h5")
    assert attrs["status"] == "completed" and attrs["num_workers"] == WORKERS
    check_shards(attrs, t)
    # every push carries every shard's slice: the bytes of one unsharded push and one more header
    assert attrs["wire_bytes_pushed"] == len(t["pushes"]) * (message_bytes(attrs["num_params"]) + HEADER_BYTES)
    assert t["workers"]["rank"].tolist() == list(range(1, WORKERS + 1))
    meta = t["snapshots/meta"]
    assert meta["version"][0] == 0 and meta["version"][-1] == attrs["version"]
    assert np.isfinite(params).all() and not np.array_equal(params[0], params[-1])
    assert attrs["test_accuracy"] > 0.5 and attrs["test_count"] == 360  # chance: 0.1
    ck = checkpoint.load(str(tmp_path / "runs" / "s.ckpt.h5"))  # the final weights, assembled
    np.testing.assert_array_equal(ck.params, params[-1])
    assert ck.shard_versions.tolist() == list(attrs["shard_versions"])


@pytest.mark.parametrize("flags", [
    ["--wire", "bf16", "--wire-error-feedback"],
    ["--nsync", "2"],
    ["--mode", "ssp", "--staleness-bound", "1"],
    ["--dc-lambda", "0.5", "--dc-adaptive", "0.9"],
    ["--lookahead", "-1", "--staleness-lr", "inverse", "--eval-interval", "0.5ep"],
    ["--overlap", "--lookahead", "-1"],
    ["--overlap", "--nsync", "2", "--wire", "fp16", "--eval-interval", "0.5ep"],
], ids=["bf16", "nsync2", "ssp", "dc-asgd", "lookahead-evals", "overlap", "overlap-nsync2-fp16-evals"])
def test_two_shards_in_every_server_option(mpirun, tmp_path, flags):
    res = mpirun(RANKS, ["train", *FAST, "--servers", str(SERVERS), *flags, "--epochs", "2", "--name", "o"],
                 timeout=180)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "o.h5")
    assert attrs["status"] == "completed"
    check_shards(attrs, t)
    assert np.isfinite(params).all() and attrs["test_accuracy"] > 0.3, res.explain()
    if "--eval-interval" in flags:
        assert len(t["periodic_evals"]) >= 2 and (t["periodic_evals"]["count"] == 360).all()
    if "ssp" in flags:  # each shard held the fast worker's replies on its own clock; the log has rank 0's
        assert attrs["held_s"] >= 0
    if "--overlap" in flags:  # a push is computed on the weights of the reply before the last: the worker's own
        pushes = t["pushes"]  # previous push was applied after them (staleness >= 1 from its second push on)
        later = pushes[(pushes["step"] > 2) & (pushes["applied"] == 1)]
        assert len(later) > 10 and (later["staleness"] >= 1).all(), later["staleness"]


def test_two_shards_resume_continues_every_shards_versions(mpirun, tmp_path):
    common = [*FAST, "--servers", str(SERVERS), "--epochs", "0", "--lr-schedule", "constant"]
    res = mpirun(RANKS, ["train", *common, "--max-pushes", "60", "--name", "r"], timeout=120)
    assert res.returncode == 0, res.explain()
    first = checkpoint.load(str(tmp_path / "runs" / "r.ckpt.h5"))
    # every shard applied the same pushes: the 60th, and each other worker's push that a shard had applied when it
    # heard of the stop (at most one per other worker)
    assert 60 <= first.version < 60 + WORKERS and first.shard_versions.tolist() == [first.version] * SERVERS
    res = run_mpi(RANKS, ["train", "--resume", "runs/r.ckpt.h5", "--max-pushes", "120", "--no-progress"], 120,
                  tmp_path)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "r.h5")
    assert attrs["status"] == "completed" and 120 <= attrs["version"] < 120 + WORKERS
    versions = check_shards(attrs, t, resumed_from=first.shard_versions, jobs=2)  # (bytes and staleness: both jobs')
    check_continued(t, first, versions)
    final = checkpoint.load(str(tmp_path / "runs" / "r.ckpt.h5"))
    assert final.shard_versions.tolist() == versions
    # a resume that trains nothing: every shard's staleness and bytes still those of the whole run, not zeros
    res = run_mpi(RANKS, ["train", "--resume", "runs/r.ckpt.h5", "--max-pushes", "120", "--no-progress"], 120,
                  tmp_path)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "r.h5")
    check_shards(attrs, t, resumed_from=first.shard_versions, jobs=3)
    assert list(attrs["shard_staleness_max"]) != [0, 0] and "staleness mean 0.00 max 0" not in res.stdout
    # a different --servers is refused: the checkpoint holds two shards' state
    res = run_mpi(3, ["train", "--resume", "runs/r.ckpt.h5", "--servers", "1", "--max-pushes", "200"], 60, tmp_path)
    assert res.returncode == 2 and "config key 'servers' = 1: a resumed run keeps 2" in res.stderr, res.explain()


def test_interval_checkpoints_are_one_cut_of_every_shard_and_a_run_resumes_from_one(tmp_path):
    """An interval checkpoint with S = 2 is taken in a pause (`mpiasgd.rank0.shard_hub`): both shards hold the same
    pushes, those its worker rows name (no push is rejected or dropped before the stop: version = the workers'
    steps), however many pushes were in flight. Before the pause one shard's slice could be a push or two ahead
    of the other's (seen in 2 of 6 checkpoints). Each checkpoint file the run writes is copied as it appears;
    the run then resumes from one in the middle and every shard counts on from it."""
    proc = start_mpi(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "0", "--lr-schedule",
                             "constant", "--max-time", "5", "--checkpoint-interval", "0.25", "--name", "c"], tmp_path)
    runs, copies, seen = tmp_path / "runs", [], set()
    try:
        while proc.poll() is None:
            try:
                st = os.stat(runs / "c.ckpt.h5")
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_ino, st.st_mtime_ns) not in seen:  # (written to a temporary, renamed)
                seen.add((st.st_ino, st.st_mtime_ns))
                copies.append(tmp_path / f"copy{len(copies)}.ckpt.h5")
                try:
                    copies[-1].write_bytes((runs / "c.ckpt.h5").read_bytes())
                except FileNotFoundError:
                    copies.pop()
            time.sleep(0.02)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, err
    cuts = []
    for path in copies:
        try:
            ck = checkpoint.load(str(path))
        except checkpoint.CheckpointError:  # copied while the next one replaced it: a torn copy, not the file's
            continue
        if ck.reason == "interval":
            cuts.append((path, ck))
            assert ck.shard_versions.tolist() == [ck.version] * SERVERS, (path.name, ck.shard_versions, ck.version)
            assert ck.version == int(ck.workers["step"].sum()), (path.name, ck.version, ck.workers)
    # a pause before the first push is a cut too (version 0: seen in CI, workers slow to start on a loaded box)
    cuts = [(path, ck) for path, ck in cuts if ck.version > 0]
    assert len(cuts) >= 4, [p.name for p in copies]
    path, first = cuts[len(cuts) // 2]
    (runs / "c.ckpt.h5").write_bytes(path.read_bytes())
    res = run_mpi(RANKS, ["train", "--resume", "runs/c.ckpt.h5", "--max-pushes", str(first.version + 200),
                          "--no-progress"], 120, tmp_path)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(runs / "c.h5")
    assert attrs["status"] == "completed" and first.version + 200 <= attrs["version"] < first.version + 200 + WORKERS
    versions = list(attrs["shard_versions"])
    assert versions == [attrs["version"]] * SERVERS
    resume = float(t["events"]["time"][t["events"]["kind"] == b"resume"][0])
    for s in range(SERVERS):  # every shard counts on from the checkpoint's version, which is every shard's
        rows = shard_rows(t, s)
        later = rows[(rows["time"] >= resume) & (rows["applied"] == 1)]
        assert later["version"].tolist() == list(range(first.version + 1, versions[s] + 1))
    for w in range(1, WORKERS + 1):  # each worker goes on from its step in the checkpoint
        row = first.workers[first.workers["rank"] == w][0]
        pushes = t["pushes"]
        steps = pushes["step"][(pushes["worker"] == w) & (pushes["time"] >= resume)].tolist()
        assert steps[0] == int(row["step"]) + 1 and steps == list(range(steps[0], steps[0] + len(steps)))
    run = load(str(runs / "c.h5"))  # what a reader counts: the first job's rows after that checkpoint left out
    for s in range(SERVERS):  # by step (their times, mapped from shard 1's clock, put one on the wrong side)
        rows = run["shard_pushes"][run["shard_pushes"]["shard"] == s]
        applied = rows[rows["applied"] == 1]
        assert sorted(applied["version"].tolist()) == list(range(1, versions[s] + 1))  # each version once
        pairs = rows[["worker", "step"]].tolist()
        assert len(set(pairs)) == len(pairs)  # each push once
        assert attrs["shard_staleness_mean"][s] == pytest.approx(applied["staleness"].mean())
        assert attrs["shard_staleness_max"][s] == applied["staleness"].max()


EASGD = ["--mode", "easgd", "--easgd-tau", "2", "--lr", "0.05"]


def test_two_shards_train_digits_with_easgd(mpirun, tmp_path):
    """--mode easgd: each shard holds its slice of the center variable; every exchange moves every slice; the
    evaluations during training evaluate the center assembled from every shard's slice."""
    res = mpirun(RANKS, ["train", *FAST, *EASGD, "--servers", str(SERVERS), "--epochs", "3", "--eval-interval", "1ep",
                         "--name", "e"], timeout=180)
    assert res.returncode == 0, res.explain()
    assert f"shard 1 (rank {SHARD_RANK})" in res.stdout, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "e.h5")
    assert attrs["status"] == "completed" and attrs["mode"] == "easgd" and attrs["num_workers"] == WORKERS
    check_shards(attrs, t)
    # every exchange carries x_i, all of it: the bytes of one unsharded push and one more header
    assert attrs["wire_bytes_pushed"] == len(t["pushes"]) * (message_bytes(attrs["num_params"]) + HEADER_BYTES)
    assert t["pushes"]["samples"].max() == 2 * 16  # tau 2 local steps of 16 images
    evals = t["periodic_evals"]
    assert len(evals) >= 2 and (evals["epoch"] < 3).all() and (evals["count"] == 360).all(), evals
    assert (evals["top1"] > 0.3).all() and (evals["version_min"] <= evals["version_max"]).all(), evals
    assert np.isfinite(params).all() and not np.array_equal(params[0], params[-1])
    assert attrs["test_accuracy"] > 0.8 and attrs["test_count"] == 360, res.explain()  # chance: 0.1
    ck = checkpoint.load(str(tmp_path / "runs" / "e.ckpt.h5"))  # the final center, assembled
    np.testing.assert_array_equal(ck.params, params[-1])
    assert not ck.momentum.any()  # the workers hold their velocity
    assert ck.shard_versions.tolist() == list(attrs["shard_versions"]) == [attrs["version"]] * SERVERS


def test_two_shards_resume_easgd_continues_every_shards_versions(mpirun, tmp_path):
    common = [*FAST, *EASGD, "--servers", str(SERVERS), "--epochs", "0", "--lr-schedule", "constant"]
    res = mpirun(RANKS, ["train", *common, "--max-pushes", "40", "--name", "er"], timeout=120)
    assert res.returncode == 0, res.explain()
    first = checkpoint.load(str(tmp_path / "runs" / "er.ckpt.h5"))
    assert first.mode == "easgd" and 40 <= first.version < 40 + WORKERS
    assert first.shard_versions.tolist() == [first.version] * SERVERS
    res = run_mpi(RANKS, ["train", "--resume", "runs/er.ckpt.h5", "--max-pushes", "80", "--no-progress"], 120,
                  tmp_path)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "er.h5")
    assert attrs["status"] == "completed" and 80 <= attrs["version"] < 80 + WORKERS
    versions = check_shards(attrs, t, resumed_from=first.shard_versions, jobs=2)
    check_continued(t, first, versions)
    final = checkpoint.load(str(tmp_path / "runs" / "er.ckpt.h5"))
    assert final.shard_versions.tolist() == versions
    np.testing.assert_array_equal(final.params, params[-1])
    assert np.isfinite(params).all() and attrs["test_accuracy"] > 0.3, res.explain()


def shard_pid(runs, name):
    attrs, _, _ = read_log(runs / f"{name}.h5")
    return int(json.loads(attrs["shard_processes"])[0][2])


def wait_for_checkpoint(runs, name, proc):
    """Once the running job writing RUNS/NAME.h5 has pushed and written its first checkpoint (within 60 s)."""
    wait_for_pushes(runs / f"{name}.h5", proc)
    deadline = time.monotonic() + 60
    while not (runs / f"{name}.ckpt.h5").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_killed_shard_ends_the_job_naming_it(tmp_path):
    proc = start_mpi(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "0", "--max-time", "120",
                             "--checkpoint-interval", "0.5", "--name", "k"], tmp_path)
    runs = tmp_path / "runs"
    try:
        wait_for_checkpoint(runs, "k", proc)
        start = time.monotonic()
        pid = shard_pid(runs, "k")
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        stop_group(proc)
    assert proc.returncode != 0 and elapsed < 30, (proc.returncode, elapsed, err)
    # the launcher's SIGTERM reaches rank 0 (between messages, or while it waits for that shard's slice: it
    # looks for dead shards then too), which names the shard and closes the log before the launcher's SIGKILL
    assert f"parameter-server shard rank {SHARD_RANK} (pid {pid}" in err, err
    attrs, t, _ = read_log(runs / "k.h5")
    assert attrs["status"] == "failed", err
    failed = [e["text"].decode() for e in t["events"] if e["kind"] == b"failed"]
    assert failed and failed[-1].startswith(f"parameter-server shard rank {SHARD_RANK} on "), failed
    assert "(the slice of parameter-server shard rank" in failed[-1]  # no checkpoint of a lost slice
    ck = checkpoint.load(str(runs / "k.ckpt.h5"))  # the last interval checkpoint: intact, every shard's version
    assert ck.reason == "interval" and ck.shard_versions.size == SERVERS


@pytest.mark.parametrize("mode", [[], EASGD], ids=["async", "easgd"])
def test_signal_on_a_shard_checkpoints_and_the_run_resumes(tmp_path, mode):
    proc = start_mpi(RANKS, ["train", *FAST, *mode, "--servers", str(SERVERS), "--epochs", "0", "--max-time", "120",
                             "--name", "p"], tmp_path)
    runs = tmp_path / "runs"
    try:
        wait_for_pushes(runs / "p.h5", proc)
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(shard_pid(runs, "p"), signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        stop_group(proc)
    assert proc.returncode == PREEMPTED and elapsed < 10, (proc.returncode, elapsed, err)
    assert f"rank {SHARD_RANK}: SIGTERM received" in err, err
    attrs, t, _ = read_log(runs / "p.h5")
    assert attrs["status"] == "preempted" and not (t["evals"]["snapshot"] == -1).any()
    preempt = [e["text"].decode() for e in t["events"] if e["kind"] == b"preempt"]
    assert preempt == [f"a signal received by parameter-server shard rank {SHARD_RANK}"], preempt
    ck = checkpoint.load(str(runs / "p.ckpt.h5"))
    assert ck.reason == "preempt" and ck.shard_versions.tolist() == [ck.version] * SERVERS and ck.version > 0
    res = run_mpi(RANKS, ["train", "--resume", "runs/p.ckpt.h5", "--max-time", str(ck.elapsed + 1.0),
                          "--no-progress"], 120, tmp_path)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(runs / "p.h5")
    assert attrs["status"] == "completed" and attrs["shard_versions"][1] > ck.shard_versions[1]


@pytest.mark.parametrize("servers", [1, SERVERS])
def test_sigterm_to_mpiexec_logs_every_shards_rows_and_says_how_to_resume(tmp_path, servers):
    """SIGTERM to Open MPI's mpiexec (Ctrl-C, a batch job's end): it forwards no rank's output after it and SIGKILLs
    every rank 0.25 s after passing the signal on. Rank 0 still prints its one line, on the launcher's own stderr:
    preempted, where the checkpoint goes, the flag to resume (nothing was printed). With 2 shards (rows sent every 5
    s here, --flush-interval) the log holds shard 1's rows up to the signal as it holds shard 0's (those since its
    last SHARD_ROWS were lost: hundreds of rows fewer than shard 0's)."""
    ranks = WORKERS + servers
    proc = start_mpi(ranks, ["train", *FAST, "--servers", str(servers), "--flush-interval", "5", "--epochs", "0",
                             "--max-time", "120", "--name", "t"], tmp_path)
    runs = tmp_path / "runs"
    try:
        wait_for_pushes(runs / "t.h5", proc)  # (the first flush, 5 s in: shard 1 has sent its rows about then)
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    said = [line for line in err.splitlines() if "run preempted" in line]
    assert len(said) == 1, err
    assert said[0] == ("mpiasgd: run preempted (SIGTERM received by rank 0): writing its checkpoint 'runs/t.ckpt.h5' "
                       "(killed before that ends, the previous one there is kept); continue with --resume "
                       "runs/t.ckpt.h5"), err
    attrs, t, _ = read_log(runs / "t.h5")
    assert attrs["status"] == "preempted", err
    if servers > 1:
        counts = [len(shard_rows(t, s)) for s in range(SERVERS)]
        assert counts[0] > 0 and abs(counts[1] - counts[0]) <= WORKERS, counts  # (a push in flight per worker)


def test_shard_exception_aborts_the_job_naming_it(mpirun, tmp_path):
    res = mpirun(RANKS, ["server", str(SHARD_RANK), *FAST, "--servers", str(SERVERS), "--epochs", "50",
                         "--name", "x"], timeout=90, script="fault.py")
    assert res.returncode != 0 and res.seconds < 60, res.explain()
    assert "injected server failure" in res.stderr, res.explain()
    assert f"parameter-server shard rank {SHARD_RANK} on" in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "x.h5")
    assert attrs["status"] == "failed"
    failed = [e["text"].decode() for e in t["events"] if e["kind"] == b"failed"]
    assert failed and "injected server failure" in failed[0]


@pytest.mark.parametrize("snapshots,timeout,checkpoints", [("0", "3", "0"), ("0.2", "6", "0"), ("0", "2", "0.1")])
def test_hung_shard_is_named_and_the_job_ends(tmp_path, snapshots, timeout, checkpoints):
    """A SIGSTOPped shard: the job ends naming it, whether rank 0 notices its silence between messages or while
    it waits for the shard's slice of a snapshot; that wait (6 s: longer than PAUSE_GAP) is not reported as a
    pause of rank 0. With interval checkpoints (pauses) the workers, waiting for the shard's replies, fall silent
    with it: the shard is still the one named (it was the workers in 12 of 22 such runs before rank 0 looked at
    the shards first)."""
    proc = start_mpi(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "0", "--max-time", "120",
                             "--comm-timeout", timeout, "--checkpoint-interval", checkpoints, "--snapshot-interval",
                             snapshots, "--name", "h"], tmp_path)
    runs = tmp_path / "runs"
    try:
        wait_for_pushes(runs / "h.h5", proc)
        pid = shard_pid(runs, "h")
        os.kill(pid, signal.SIGSTOP)  # hung: alive, silent
        _, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert proc.returncode != 0, err
    assert f"parameter-server shard 1 (rank {SHARD_RANK}) has sent nothing" in err or \
        f"from parameter-server shard 1 (rank {SHARD_RANK}) after" in err, err
    attrs, t, _ = read_log(runs / "h.h5")
    assert attrs["status"] == "failed"
    # (the launcher wakes the stopped shard to end it: that shard may say that IT was paused, truly)
    assert "rank 0 was paused" not in err and not (t["events"]["kind"] == b"pause").any(), err


def test_a_stopped_shard_is_warned_about_before_the_workers_waiting_for_it(tmp_path):
    """A SIGSTOPped shard, --stall-warning 1: the first stall warning names the shard, not the workers that wait
    for its replies and fall silent with it (issue 36: they were named first); the run then ends naming it."""
    proc = start_mpi(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "0", "--max-time", "120",
                             "--comm-timeout", "5", "--stall-warning", "1", "--checkpoint-interval", "0",
                             "--snapshot-interval", "0", "--name", "sw"], tmp_path)  # (no snapshot: no SLICE wait)
    runs = tmp_path / "runs"
    try:
        wait_for_pushes(runs / "sw.h5", proc)
        os.kill(shard_pid(runs, "sw"), signal.SIGSTOP)  # hung: alive, silent
        _, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert proc.returncode != 0, err
    warnings = [line for line in err.splitlines() if "has sent nothing for" in line and "--stall-warning" in line]
    assert warnings, err
    first = f"mpiasgd: warning: parameter-server shard 1 (rank {SHARD_RANK}) has sent nothing for "
    assert warnings[0].startswith(first), err
    assert "the workers waiting for its replies fall silent with it" in warnings[0], err
    assert sum("parameter-server shard 1" in line for line in warnings) == 1, err  # once per silence
    assert f"rank 0: parameter-server shard 1 (rank {SHARD_RANK}) has sent nothing for " in err or \
        f"from parameter-server shard 1 (rank {SHARD_RANK}) after" in err, err  # the end names it too


@pytest.mark.parametrize("how", ["hung", "killed"])
def test_a_hung_or_dead_worker_leaves_the_last_consistent_checkpoint(tmp_path, how):
    """With S = 2 and interval checkpoints: a SIGSTOPped worker ends the job naming it after --comm-timeout; a
    killed one ends it, and when rank 0 gets to it before the launcher's SIGKILL (usually: 5 of 6 runs; it may be
    waiting for a shard's slice in a pause that the dead worker's last push would have completed, and looks for
    dead workers there too; the log was left 'running' in 6 of 9 such runs before) names it and closes the log
    as failed. No failure checkpoint is written with S > 1 (its slices
    would not be one cut: seen 1-2 versions apart); the last interval checkpoint is kept, consistent."""
    proc = start_mpi(RANKS, ["train", *FAST, "--servers", str(SERVERS), "--epochs", "0", "--max-time", "120",
                             "--comm-timeout", "3", "--checkpoint-interval", "0.1", "--name", "w"], tmp_path)
    runs = tmp_path / "runs"
    try:
        wait_for_checkpoint(runs, "w", proc)
        time.sleep(0.5)
        _, t, _ = read_log(runs / "w.h5")
        pid = int(t["workers"]["pid"][t["workers"]["rank"] == 1][0])
        start = time.monotonic()
        os.kill(pid, signal.SIGSTOP if how == "hung" else signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        stop_group(proc)
    assert proc.returncode != 0 and elapsed < 30, (proc.returncode, elapsed, err)
    attrs, t, _ = read_log(runs / "w.h5")
    if how == "hung":
        assert "worker rank 1 has sent nothing" in err, err
        assert "no checkpoint written at the failure: with --servers" in err, err
        assert attrs["status"] == "failed", err
    elif attrs["status"] != "running":  # (the launcher's SIGKILL may reach rank 0 first: docs: "usually")
        # the log names the dead worker (the early close on the launcher's SIGTERM: the "preempt" event, "worker rank
        # 1 (pid P on HOST) has exited"; later, the "failed" event); rank 0's line may not reach the output
        said = " ".join(e["text"].decode() for e in t["events"] if e["kind"] in (b"failed", b"preempt"))
        assert attrs["status"] == "failed" and ("worker rank 1 on" in err or "worker rank 1 " in said), (err, said)
    ck = checkpoint.load(str(runs / "w.ckpt.h5"))
    assert ck.reason == "interval" and ck.shard_versions.tolist() == [ck.version] * SERVERS, (ck.reason, ck.version)
    assert ck.version == int(ck.workers["step"].sum()) > 0


def test_too_few_ranks_for_the_shards_is_one_error(mpirun):
    res = mpirun(2, ["train", *FAST, "--servers", "2", "--epochs", "1"], timeout=60)
    assert res.returncode == 2, res.explain()
    assert "mpiasgd train --servers 2 needs at least 3 MPI ranks" in res.stderr, res.explain()
    res = mpirun(1, ["train", *FAST, "--servers", "2", "--epochs", "1"], timeout=60)  # one rank: the same advice
    assert res.returncode == 2, res.explain()
    assert ("mpiasgd train --servers 2 needs at least 3 MPI ranks (2 parameter-server shards + workers), got 1; "
            "launch it with e.g. 'mpiexec -n 4 python") in res.stderr, res.explain()


def test_two_shards_with_layer_buffers(mpirun, tmp_path):
    """A network with BatchNorm (tests/mpi/nets/small_bn.py): shard 0 carries the layer buffers; the final
    snapshot and the checkpoint hold the same assembled weights and buffers (--wire fp16 on every message)."""
    from kit.launch import REPO

    net = str(REPO / "tests" / "mpi" / "nets" / "small_bn.py") + ":build"
    res = mpirun(RANKS, ["train", *FAST, "--model", net, "--dataset", "digits", "--servers", str(SERVERS),
                         "--wire", "fp16", "--epochs", "0", "--max-pushes", "60", "--name", "bn"], timeout=180)
    assert res.returncode == 0, res.explain()
    from mpiasgd.runlog import open_log

    with open_log(str(tmp_path / "runs" / "bn.h5")) as f:
        attrs, params, buffers = dict(f.attrs), f["snapshots/params"][()], f["snapshots/buffers"][()]
    assert attrs["num_buffers"] > 0 and json.loads(attrs["shard_bounds"])[-1] == attrs["num_params"]
    assert np.isfinite(buffers).all() and not np.array_equal(buffers[0], buffers[-1])
    ck = checkpoint.load(str(tmp_path / "runs" / "bn.ckpt.h5"))
    np.testing.assert_array_equal(ck.params, params[-1])
    np.testing.assert_array_equal(ck.buffers, buffers[-1])
    assert list(attrs["shard_versions"]) == ck.shard_versions.tolist() and 60 <= ck.version < 60 + WORKERS
