"""Short digits runs and their logs: the flags the multi-rank tests share, and readers of a run log."""

from __future__ import annotations

from mpiasgd.runlog import open_log

B = 16  # the minibatch of FAST runs, and of the in-process workers and references built to match them
FAST = ["--model", "digits", "--batch-size", "16", "--snapshot-interval", "0.2", "--flush-interval", "0.2",
        "--no-progress", "--comm-timeout", "60"]


def read_log(path):
    with open_log(str(path)) as f:
        return ({k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()},
                {name: f[name][()] for name in ("pushes", "updates", "evals", "periodic_evals", "workers",
                                                "snapshots/meta", "events", "checkpoints", "shard_pushes")
                 if name in f},
                f["snapshots/params"][()])


def wait_for_pushes(path, proc, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open_log(str(path)) as f:
                if f["pushes"].shape[0] > 0:
                    return
        except (OSError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no pushes in {path} within {timeout} s")
