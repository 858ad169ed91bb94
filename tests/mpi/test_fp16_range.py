"""--wire fp16 beyond its range, end to end: the one line a run ends with names the cause (the value, fp16's
range [-65504, 65504], --wire bf16), not divergence; with --servers 2 as with one server. (The messages are
searched for, not matched as whole lines: mpiexec sometimes joins the ranks' stderr lines with its own.)"""

from __future__ import annotations

import re

import pytest
from kit import TESTS
from kit.runs import FAST, read_log

LOUD = f"{TESTS / 'mpi' / 'nets' / 'loud.py'}:build"
RANGE = r"\[-65504, 65504\]"


@pytest.mark.parametrize("servers", [1, 2])
def test_gradients_beyond_fp16_range_end_the_run_naming_them_at_any_step_size(mpirun, tmp_path, servers):
    """lr 1e-12: every push of worker 1 holds a value beyond 65504 (tests/mpi/nets/loud.py); the warning and the
    --max-rejects stop (rank 0's, or with --servers 2 maybe shard 1's, which counts the rejects of its slice
    too) name its largest magnitude and --wire bf16, and nothing says "diverged"."""
    res = mpirun(2 + servers, ["train", *FAST, "--model", LOUD, "--dataset", "digits", "--wire", "fp16", "--lr",
                               "1e-12", "--epochs", "0", "--max-pushes", "200", "--max-rejects", "3", "--servers",
                               str(servers), "--name", "loud"], timeout=120)
    assert res.returncode != 0, res.explain()
    assert re.search(r"mpiasgd: warning: worker rank [12] pushed a gradient beyond fp16's range at step \d+ \(its "
                     rf"largest magnitude [0-9.e+]+; --wire fp16 holds {RANGE}\): rejected \(not applied\); use --wire "
                     r"bf16 \(float32's range\)", res.stderr), res.explain()
    assert re.search(r"rank (0|3 \(parameter-server shard 1\)): worker rank [12] pushed 3 gradients in a row beyond "
                     r"fp16's range \(steps \d+\.\.\d+; "
                     rf"--max-rejects 3; the largest magnitude [0-9.e+]+; --wire fp16 holds {RANGE}\): the values are "
                     r"finite, only too large for fp16: use --wire bf16 \(float32's range\)", res.stderr), \
        res.explain()
    assert "diverged" not in res.stderr and "Traceback" not in res.stderr, res.explain()
    assert read_log(tmp_path / "runs" / "loud.h5")[0]["status"] == "failed"


def test_weights_beyond_fp16_range_end_the_run_before_a_reply_carries_inf(mpirun, tmp_path):
    """lr 1e7: an update throws the weights beyond 65504; the server stops before it encodes them into a reply
    (the workers would compute NaN on inf and the run end as 'diverged; lower --lr')."""
    res = mpirun(3, ["train", *FAST, "--wire", "fp16", "--lr", "1e7", "--epochs", "0", "--max-pushes", "200",
                     "--name", "big"], timeout=120)
    assert res.returncode != 0, res.explain()
    assert re.search(r"rank 0: WEIGHTS reply to worker rank [12] \(step \d+, version \d+\): a weight "
                     r"(\(looking ahead\) )?of magnitude "  # (the default for 2 workers, DANA-GA, replies ahead)
                     rf"[0-9.e+]+ is beyond fp16's range {RANGE} \(--wire fp16\): it would travel as inf and the "
                     r"worker compute NaN; use --wire bf16 \(float32's range\) or lower --lr", res.stderr), \
        res.explain()
    assert "non-finite" not in res.stderr and "Traceback" not in res.stderr, res.explain()
