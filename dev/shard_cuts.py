"""Check a sharded run's log and checkpoint: every shard at one version (`shard_versions`), and the checkpoint one
consistent cut (every shard's version its `version`). Used by dev/shard_cuts.sh.

    python dev/shard_cuts.py runs/x.h5 runs/x.ckpt.h5
"""

from __future__ import annotations

import sys

from mpiasgd import checkpoint
from mpiasgd.runlog import open_log


def main(log: str, ckpt_path: str) -> int:
    with open_log(log) as f:
        status = f.attrs["status"]
        versions = [int(v) for v in f.attrs.get("shard_versions", [])]
        reasons = f["checkpoints"]["reason"][()]
    ck = checkpoint.load(ckpt_path)
    cut = [int(v) for v in ck.shard_versions]
    ok = len(set(versions)) <= 1 and cut == [ck.version] * len(cut)
    verdict = "consistent" if ok else "NOT ONE CUT"
    print(f"{status}: shard versions {versions}; {len(reasons)} checkpoints ({int((reasons == b'interval').sum())} "
          f"interval); the last: {ck.reason} version {ck.version} shards {cut} -> {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
