"""The workers' side of the parameter-server shards (`--servers S > 1`, async, ssp and easgd): one message
each way per shard (`mpiasgd.comms.shard_cut`; on rank 0's side `mpiasgd.rank0.server`).

A worker's exchange with S shards (`AsgdWorker.train_sharded`, `EasgdWorker.train_sharded`): it posts the S
receives of the replies, then the S pushes, the push to shard s carrying its slice of the vector (the
staging's `ShardedStaging` cuts it) and the version of shard s's slice it last got (`post_exchange`), and
waits for all S replies (`receive_replies`: each checked as `receive_weights` checks one server's,
`check_reply`). The step size, flags and buffers come from shard 0 (rank 0). When one shard answers STOP and
another WEIGHTS (the push reached it before it had settled after the stop), the worker sends the latter FINISH
and waits for its STOP (`finish_shards`), so that it ends with every shard's final slice.

A shard checks only its own slice of a push for values that are not finite. So the staging's `before_send`
checks the whole push as it travels (after the `--wire` encoding: an fp16 value beyond range is inf) and sets
flag NONFINITE on all S pushes when any parameter's value is not; every shard rejects a flagged push as one whose
own slice is not finite (the same row, `applied` 0, the same count against `--max-rejects`, the same reply), so
all shards keep applying the same pushes. What a shard computes from the push itself is not covered: DC-ASGD's
correction (`--dc-lambda`) can make one shard's slice non-finite, which that shard alone then rejects.
"""

from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from mpiasgd.comms import Flag, Message, ProtocolError, SendSlots, Tag, check, check_size, parse_tag, wait, wait_all
from mpiasgd.modes.base import WorkerLoop


class ShardedWorker(WorkerLoop):
    """(workers) A worker loop of a parameter-server mode, with the exchange of `--servers S > 1` (module
    docstring): `self.staging` is then a ShardedStaging, shard s's messages in `staging.weights[s]` and
    `staging.push[s]`."""

    def shard_ranks(self) -> list[int]:
        """The ranks of the S parameter-server shards, shard 0 (rank 0) first."""
        return self.staging.cut.ranks(self.comm.Get_size() - self.cfg.servers)

    def post_exchange(self, pushes: SendSlots, ranks: list[int], staging: Any = None, replies: Any = None,
                      first_slot: int = 0) -> list:
        """Post the receive of every shard's reply (into `replies`, default `staging`), then every shard's push
        (stamped and staged: `before_send` done, which set flag NONFINITE on each if the whole push is not
        finite) from `staging` (default `self.staging`), shard s's from slot `first_slot + s` of `pushes`;
        returns the receives. Every receive is posted before its push is sent."""
        staging = staging or self.staging
        receives = self.post_replies(ranks, replies or staging)
        for s, r in enumerate(ranks):
            pushes.post(first_slot + s, self.comm.Isend(staging.send_bufs[s], dest=r, tag=int(Tag.PUSH)))
        return receives

    def post_replies(self, ranks: list[int], staging: Any = None) -> list:
        """Post the receive of each shard's next reply (WEIGHTS or STOP) into its buffer of `staging` (default
        `self.staging`); the requests."""
        bufs = (staging or self.staging).recv_bufs
        return [self.comm.Irecv(buf, source=r, tag=MPI.ANY_TAG) for buf, r in zip(bufs, ranks, strict=True)]

    def receive_replies(self, receives: list, ranks: list[int], versions: list[int], what: str,
                        timeout: float = 0.0, initial: bool = False, staging: Any = None) -> tuple[list[Tag], float]:
        """Wait for every shard's reply into `staging` (default `self.staging`; each within `timeout`, default the
        worker's: CommTimeout naming the shard and its rank), check each (`check_reply`), then copy them into
        its weights; returns (their tags, seconds waited)."""
        staging = staging or self.staging
        t = time.perf_counter()
        tags = []
        for s, (request, r) in enumerate(zip(receives, ranks, strict=True)):
            status = self.wait_reply(request, s, r, f"{what} from parameter-server shard {s} (rank {r})",
                                     timeout or self.cfg.worker_timeout, staging)
            tags.append(self.check_reply(s, r, status, versions, initial, staging))
        staging.after_receive()
        return tags, time.perf_counter() - t

    def wait_reply(self, request: Any, s: int, r: int, what: str, timeout: float, staging: Any) -> Any:
        """Wait for shard `s`'s (rank `r`'s) reply into `staging` (CommTimeout after `timeout` s naming `what`);
        its status. (ULFM) A LOST message from rank 0, which comes before its reply, is taken (`on_lost`) and
        the reply waited for again."""
        status = MPI.Status()
        wait(request, what, self.rank, timeout, status)
        while s == 0 and parse_tag(status.Get_tag(), r, self.rank) == Tag.LOST:
            self.take_lost(staging.weights[0].header.tobytes(), status.Get_count(MPI.BYTE), r)
            request = self.comm.Irecv(staging.recv_bufs[0], source=r, tag=MPI.ANY_TAG)
            wait(request, what, self.rank, timeout, status)
        return status

    def check_reply(self, s: int, r: int, status: Any, versions: list[int], initial: bool = False,
                    staging: Any = None) -> Tag:
        """The tag of shard `s`'s reply (from rank `r`, in `staging`, default `self.staging`), after the checks of
        `receive_weights` against that shard's last version (`versions[s]`, updated); a resumed run's initial
        weights from shard 0 set this worker's step, data position and clock. ProtocolError naming the shard."""
        msg = (staging or self.staging).weights[s]
        tag = parse_tag(status.Get_tag(), status.Get_source(), self.rank)
        shard = f"parameter-server shard {s} (rank {r})"
        if tag not in (Tag.WEIGHTS, Tag.STOP):
            raise ProtocolError(f"rank {self.rank}: expected WEIGHTS or STOP from {shard}, got {tag.name}")
        check_size(tag, r, self.rank, status.Get_count(MPI.BYTE), msg.count, msg.wire, f" from {shard}")
        check(msg, tag, r, self.rank)
        version, step, flags = int(msg.header["version"]), int(msg.header["step"]), int(msg.header["flags"])
        if initial and s == 0 and flags & Flag.RESUME:
            self.resume(msg.header)
        if tag == Tag.STOP and flags & Flag.PREEMPT:
            self.preempted = True
        if step != self.step or version < versions[s]:
            raise ProtocolError(f"rank {self.rank}: {tag.name} from {shard} answers step {step} at version {version}; "
                                f"expected step {self.step} at version >= {versions[s]}")
        versions[s] = version
        if s == 0:
            self.version = version
        return tag

    def finish_shards(self, tags: list[Tag], ranks: list[int], versions: list[int], staging: Any = None) -> None:
        """Some shard answered STOP: ask each shard that answered WEIGHTS for its final slice (FINISH) and wait
        for its STOP (into `staging`, default `self.staging`, the one the replies of `tags` are in); its weights
        are then every shard's final slice."""
        staging = staging or self.staging
        open_ = [s for s, tag in enumerate(tags) if tag == Tag.WEIGHTS]
        if not open_:
            return
        ask = Message(0).stamp(Tag.FINISH, self.rank, step=self.step)  # read by every send, written by none
        receives = {s: self.comm.Irecv(staging.recv_bufs[s], source=ranks[s], tag=MPI.ANY_TAG) for s in open_}
        sends = [self.comm.Isend(ask.buf, dest=ranks[s], tag=int(Tag.FINISH)) for s in open_]
        for s in open_:
            status = self.wait_reply(receives[s], s, ranks[s], f"final weights (STOP, after FINISH step {self.step}) "
                                     f"from parameter-server shard {s} (rank {ranks[s]})", self.cfg.worker_timeout,
                                     staging)
            if self.check_reply(s, ranks[s], status, versions, staging=staging) != Tag.STOP:
                raise ProtocolError(f"rank {self.rank}: parameter-server shard {s} (rank {ranks[s]}) answered FINISH "
                                    f"with WEIGHTS, expected STOP")
        wait_all(sends, "completion of the FINISH sends", self.rank, self.cfg.worker_timeout)
        staging.after_receive()
