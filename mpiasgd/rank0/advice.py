"""(rank 0, parameter-server modes) Whether the workers wait for the parameter server more than they compute,
and the one line of advice when they do.

GPU A-SGD pays off only while a worker computes more than it waits (Paine et al. 2013: n_push = n_fetch =
nsync, workers that never wait). On an H200, AlexNet-class workers (40M parameters, one server, fp32) waited
93 % of their time (docs/benchmarks/server.md). Each push's header carries the
worker's compute and wait seconds; rank 0 also knows how long it was busy with each push. From both,
`ExchangeWatch` tells the two causes apart once enough pushes are in (ADVISE_AFTER_PUSHES, ADVISE_AFTER_S):

- rank 0 busy most of the time (BUSY_SHARE): the update is the bottleneck, so cut the server into shards
  (`--servers S`) or push less often (`--nsync`);
- rank 0 mostly idle: the exchange itself is (bytes, latency, rank 0's sleeps between polls), so overlap it
  (`--overlap`), halve its bytes (`--wire bf16`), exchange less often (`--nsync`; easgd: `--easgd-tau`),
  or let rank 0 spin (`--server-wait spin`, named only where the run asked for backoff: auto backs off
  where the node has no core to spare).

Only the flags a run does not use already, and would accept, are named (no `--nsync` with DC-ASGD or the
look-ahead, which need nsync 1). The advice is an event "advice" in the run log and one
line on stderr, once per job.
"""

from __future__ import annotations

from typing import Any

WAIT_SHARE = 0.5           # advise when the workers wait more than half their time
BUSY_SHARE = 0.7           # rank 0 busy more than this share of the time: the update is the bottleneck
ADVISE_AFTER_PUSHES = 50   # pushes (all workers, each worker's first left out: start-up) before judging
ADVISE_AFTER_S = 10.0      # training seconds of this job before judging


class ExchangeWatch:
    """The workers' compute and wait seconds over their pushes, rank 0's busy seconds, and the advice (module
    docstring). `cfg` gives the flags already in use (overlap, wire, nsync, servers); `spinning`: rank 0
    polls without sleeping already (--server-wait, as resolved for its node)."""

    def __init__(self, cfg: Any, spinning: bool = False) -> None:
        self.cfg, self.spinning = cfg, spinning
        self.compute = self.wait = self.busy = 0.0
        self.pushes = 0
        self.seen: set[int] = set()   # workers whose first push (start-up, compiled code) was left out
        self.advised = False

    def push(self, w: int, compute_s: float, wait_s: float) -> None:
        """A push of worker `w` that took `compute_s` seconds to compute after waiting `wait_s` for the reply
        before it (the header's compute_s and wait_s)."""
        if w not in self.seen:
            self.seen.add(w)
            return
        self.compute += max(0.0, float(compute_s))
        self.wait += max(0.0, float(wait_s))
        self.pushes += 1

    def served(self, seconds: float) -> None:
        """Rank 0 spent `seconds` on one push (decode, update, reply)."""
        self.busy += max(0.0, seconds)

    def advice(self, elapsed: float) -> str:
        """The advice's text the first time the workers' wait share passes WAIT_SHARE after ADVISE_AFTER_PUSHES
        pushes and ADVISE_AFTER_S seconds (`elapsed`: training seconds of this job), else ""."""
        total = self.compute + self.wait
        if (self.advised or self.pushes < ADVISE_AFTER_PUSHES or elapsed < ADVISE_AFTER_S or total <= 0
                or self.wait <= WAIT_SHARE * total):
            return ""
        self.advised = True
        cfg, n = self.cfg, self.pushes
        busy = min(1.0, self.busy / elapsed)
        said = (f"the workers waited for the parameter server {100 * self.wait / total:.0f} % of their time "
                f"({1e3 * self.wait / n:.1f} ms a push against {1e3 * self.compute / n:.1f} ms of compute); ")
        easgd = cfg.mode == "easgd"  # (--overlap, --wire and --nsync are async's and ssp's)
        fewer = (f"--easgd-tau {2 * cfg.easgd_tau} (exchanges half as often)" if easgd else
                 "--nsync 4 (a push every 4 minibatches)" if cfg.nsync == 1 and not cfg.dc_lambda
                 and not cfg.lookahead else "")  # (DC-ASGD and the look-ahead need nsync 1)
        if busy > BUSY_SHARE:
            flags = [f"--servers {2 * cfg.servers} (shards: that many parameter-server ranks)", *filter(None, [fewer])]
            return said + f"rank 0 was busy {100 * busy:.0f} % of the time with the updates: try " + ", ".join(flags)
        flags = []
        if not easgd and not cfg.overlap and not cfg.dc_lambda:
            flags.append("--overlap (compute the next minibatch while the reply travels)")
        if not easgd and cfg.wire == "fp32":
            flags.append("--wire bf16 (half the bytes)")
        if fewer:
            flags.append(fewer)
        if not self.spinning and cfg.server_wait == "backoff":  # (auto backed off: the node has no core to spare)
            flags.append("--server-wait spin (rank 0 polls without sleeping; give it a core of its own)")
        what = "try " + ", ".join(flags) if flags else "a faster interconnect, or more compute per push"
        return said + f"rank 0 was busy only {100 * busy:.0f} % of the time: the exchange is the bottleneck; {what}"
