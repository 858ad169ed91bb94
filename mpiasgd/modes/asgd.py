"""`--mode async`: asynchronous SGD through a parameter server (GPU A-SGD, Paine et al. 2013, arXiv
1312.6186; Downpour SGD, Dean et al. 2012), with nsync, --overlap and the warm start.

Rank 0 applies every PUSH the moment it arrives,

    staleness = version (server, before the update) - base version (the push was computed from)
    nsync = 1:  w <- SGD-momentum step of w with the pushed gradient scaled by f(staleness)
                (v <- momentum v + f g + wd w; w <- w - lr v: see optim.SGD)
    nsync = K:  w <- w + f(staleness) * u, u = the worker's accumulated update over K local steps
    version <- version + 1

and answers with the new weights (WEIGHTS, carrying the step size for the worker's local steps),
so no worker ever waits for another. f is 1, or with `--staleness-lr inverse` 1 / max(1,
staleness) (Zhang et al. 2016, arXiv 1511.05950; `sqrt`: 1 / sqrt(max(1, staleness))).

Two more answers to staleness (`mpiasgd.optim.delay`): `--dc-lambda L` corrects a gradient g before
it enters the step, g <- g + L g * g * (w - w_pulled) (DC-ASGD, Zheng et al. 2017; `--dc-adaptive M`:
L per weight divided by the root of a running mean square of g), w_pulled being the weights the
worker computed it on: those of its last reply, which its send buffer still holds (below); and
`--async-momentum workers` lowers the server's momentum to max(0, momentum - (1 - 1/N)), since N
asynchronous workers add about 1 - 1/N of momentum themselves (Mitliagkas et al. 2016); and
`--lookahead K` replies with the weights K momentum-only updates ahead, w - lr c v (`optim.LookAhead`;
DANA, Hakimi et al. 2019), so that a push of staleness K is computed near the weights it meets.

A worker (ranks 1..N):

    pull w (version v)  ->  nsync = 1: one gradient g on w;            push g (base version v)
                            nsync = K: K local SGD steps from w to w'; push w' - w (base version v)

`--overlap` posts the pull and computes the next minibatch on the weights at hand while the reply
is in flight: the gradient pushed at step t was computed on the weights of the reply to push t-2
instead of t-1 (one more step of staleness), and the wait for the reply overlaps compute.

`--warm-start S`: only worker rank 1 gets its first weights at start-up; the others get theirs
once S seconds have passed (GPU A-SGD's warm start).

A push whose payload is not finite is rejected (not applied, counted per worker, answered with the
current weights); `--max-rejects` of them in a row from one worker stop the run with an error. (With
`--servers S > 1` below, a push whose header carries flag NONFINITE is rejected alike: the worker sets it on
all S pushes when any value of its whole push is not finite, so every shard rejects the push that one shard's
slice makes non-finite.) Once a stopping rule fires, each worker's next push is answered with STOP and the
final weights instead; the worker evaluates its slice of the test set and sends EVAL. Rank 0 holds the whole
training state, so it checkpoints it itself.

Evaluation during training (--eval-interval; `mpiasgd.rank0.evals`): when one is due on rank 0's clock
(training seconds or epochs), the next WEIGHTS reply to every running worker carries flag EVALUATE
(and rank 0's mean layer buffers, as a STOP does); the worker evaluates those weights on its test slice
before computing on them, sends EVAL (flag EVALUATE) and goes on. The slices of one evaluation come
from the versions each worker got (logged as version_min..version_max).

Buffers: on rank 0 the master weights move between the workers' send buffers: an update writes
them into the buffer of the worker it answers, so a reply costs no copy. On a worker the model's
flat parameter vector IS the payload of a receive buffer and its flat gradient vector IS the payload
of a send buffer (numpy backend; a GPU worker's `Staging` moves them). A receive is posted before the
push it answers is sent; a buffer is written only after its send completed and read only after its
receive completed. With `--overlap` there are two of each.

`--servers S` (`mpiasgd.comms.shard_cut`): S parameter-server shards, rank 0 and ranks N+1..N+S-1, each an
AsgdServer (ssp: with its SspGate) on its contiguous slice of the parameters (shard 0 also carries the layer
buffers), with its own optimizer state and version counter; `AsgdMode.rank0` gives each rank its slice. Every
rule above applies per shard: the staleness of a push is counted on each shard's own versions, DC-ASGD
corrects each slice with that shard's w_pulled, --lookahead looks ahead along each shard's velocity, ssp
holds replies on each shard's clocks, and a push is rejected on every shard when any value of it is not finite
(the worker's flag NONFINITE, on all S pushes; `mpiasgd.comms.staging.ShardedStaging`). Not covered: DC-ASGD's
correction, computed by each shard on its own slice, can make one slice non-finite while the others stay finite;
that shard alone rejects the push. A worker (`train_sharded`, with `mpiasgd.modes.sharded_worker`) posts its S
receives, then its S pushes (each carrying the version of that shard's slice it was computed from), and waits
for all S replies; the step size, flags and buffers come from shard 0. Only rank 0 decides when the run stops;
the shards then agree which pushes in flight each applies, so that all apply the same ones
(`mpiasgd.rank0.shard_agreement`); a worker that gets STOP from one shard and WEIGHTS from another sends the
latter FINISH and waits for its STOP, so all evaluate the same final weights. With S = 1 nothing of this
runs. With --overlap a worker keeps two ShardedStagings, one in use while the S replies arrive in the other.

`--wire fp16|bf16` (`mpiasgd.comms.wire`): PUSH, WEIGHTS and STOP carry their P + B values in 2 bytes
each, rounded to nearest even. Rank 0 keeps the master weights, the momentum and all other state in
float32: it decodes a push into one float32 buffer (`decoded`) before the finite check, DC-ASGD and the
update, updates the master weights in place (they no longer move between send buffers, which now hold
16-bit copies), and encodes each reply (WEIGHTS, STOP, the initial weights) into the worker's send
buffer. The weights a worker computed on are decode(encode(w)): DC-ASGD's w_pulled is decoded from the
last reply still in its send buffer, so the correction uses exactly those. The layer buffers travel in
the same format. A worker decodes a reply into its float32 weights and encodes its gradient into its
send buffer (`mpiasgd.comms.staging`), with `--wire-error-feedback` through its `ErrorFeedback`. fp16's range is
[-65504, 65504]: a finite value beyond it arrives as inf, so the worker stamps the largest magnitude it encoded
on the push (header `peak`), and a push rejected for it is named as beyond the range, with that value and the
advice --wire bf16 (`mpiasgd.health.rejects_text`), not as divergence; the server measures each reply as it
encodes it (`ShardedServer.encode_reply`) and stops the run rather than send weights or buffers beyond the
range (the worker would compute NaN on them). Rank 0
counts the bytes of every PUSH it receives and every WEIGHTS or STOP it sends (the summary's
`wire_bytes_pushed` and `wire_bytes_pulled`, in every wire format).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import checkpoint
from mpiasgd.comms import Flag, Message, ProtocolError, SendSlots, Tag
from mpiasgd.comms.wire import WIRES, decode
from mpiasgd.comms.wire import warm_up as warm_up_wire
from mpiasgd.config import Config
from mpiasgd.modes.base import LossTally, Mode, WorkerJob, initial_buffers, lr_scale, need, round_fits
from mpiasgd.modes.sharded_worker import ShardedWorker
from mpiasgd.optim import (
    SGD,
    DelayCompensation,
    GapAware,
    LocalSGD,
    LookAhead,
    explicit_momentum,
    fraction_done,
    lookahead_steps,
)
from mpiasgd.optim.delay import lookahead_factor
from mpiasgd.optim.rules import AsyncRule, DanaZero, DelayCompensated, GapPenalized
from mpiasgd.rank0.server import ReplyNow, ShardedServer, server_shard

STALENESS_LR = ("auto", "none", "inverse", "sqrt")
ASYNC_MOMENTUM = ("fixed", "workers")
UPDATE_RULES = ("auto", "sgd", "dana-zero")  # --update-rule


def dana_conflicts(cfg: Config) -> list[tuple[str, bool, str]]:
    """(key, allowed, what --update-rule dana-zero expects of it) for each option DANA-Zero's momentum per worker
    and its own look-ahead rule out."""
    rule = "with --update-rule dana-zero"
    return [("momentum", 0 < cfg.momentum < 1, f"in (0, 1) {rule} (a momentum per worker)"),
            ("nsync", cfg.nsync == 1, f"1 {rule} (it takes gradients)"),
            ("lookahead", cfg.lookahead == 0, f"0 {rule} (its replies look ahead already)"),
            ("async_momentum", cfg.async_momentum == "fixed", f"'fixed' {rule}"),
            ("staleness_lr", cfg.staleness_lr in ("none", "auto"), f"'none' or 'auto' {rule}"),
            ("dc_lambda", cfg.dc_lambda == 0, f"0 {rule}"),
            ("nesterov", not cfg.nesterov, f"False {rule} (its look-ahead is Nesterov's point already)")]


def resolve_staleness_lr(cfg: Config) -> str:
    """What `--staleness-lr` gives: as given; auto: "inverse" with nsync > 1 (each accumulated update scaled by
    1/staleness, about 1/(N - 1) with N equal workers: the workers' updates are averaged instead of added in full,
    which overshoots from N = 4 on; docs/benchmarks/asgd.md, issue 39), else "none"."""
    if cfg.staleness_lr != "auto":
        return cfg.staleness_lr
    return "inverse" if cfg.nsync > 1 else "none"


def resolve_update_rule(cfg: Config, num_workers: int) -> tuple[str, bool, str]:
    """(the rule, whether Gap-Aware penalizes the gradients, why) that `--update-rule` and `--gap-aware` give with
    `num_workers` workers: a rule as given, with Gap-Aware if `--gap-aware`; auto: "dana-zero" with Gap-Aware
    (DANA-GA) for 2 or more workers, unless an option DANA-Zero rules out is set (`dana_conflicts`: then "sgd",
    naming the option; `--overlap`: DANA-Zero without Gap-Aware, which needs the weights of the last reply),
    "sgd" for one worker (nothing is stale). Measured: docs/benchmarks/asgd.md (issue 39), where DANA-Zero was the
    best rule at every N from 2 to 16 and Gap-Aware kept it learning at 16 and 32."""
    if cfg.update_rule != "auto":
        return cfg.update_rule, cfg.gap_aware, "as given"
    if num_workers < 2:
        return "sgd", cfg.gap_aware, "1 worker: nothing is stale"
    ruled_out = [(key, expected) for key, ok, expected in dana_conflicts(cfg) if not ok]
    if ruled_out:
        key, expected = ruled_out[0]
        value = getattr(cfg, key)
        flag = f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value:g}"
                                              if isinstance(value, float) else f" {value}")
        needs = expected.replace(" with --update-rule dana-zero", "")
        return "sgd", cfg.gap_aware, f"{flag} rules out dana-zero, which needs {key.replace('_', '-')} {needs}"
    if cfg.overlap:
        return "dana-zero", False, (f"{num_workers} workers: a momentum per worker and replies one step ahead; "
                                    "without Gap-Aware, which --overlap rules out")
    return "dana-zero", True, (f"{num_workers} workers: a momentum per worker, replies one step ahead, and each "
                               "gradient divided by its gap (DANA-GA)")


class AsgdServer(ShardedServer):
    """(rank 0, or a parameter-server shard) The parameter server: master weights `params` (float32 (P,)), the
    optimizer, and a reply to every push; see the module docstring (`ShardedServer`: the replies, the shards).
    `decay_mask` (float32 (P,)) holds each weight's weight-decay multiplier, `lr_scale` its learning-rate
    multiplier (None: all 1), `buffers` (float32 (B,)) the layers' initial buffers.

    Buffers (BatchNorm's running statistics): each push carries the worker's own after its gradient;
    rank 0 keeps every worker's latest and snapshots and checkpoints their mean (`current_buffers`).
    A worker starts from the buffers of its first WEIGHTS (the initial ones, or a resumed run's), keeps
    its own while it trains (replies carry a tail it does not read), and evaluates the final weights
    with the mean its STOP carries: the final evaluation and the last snapshot use the same state.

    Wire format `cfg.wire` (module docstring): fp32, the master weights live in the send buffers
    (`weights[w]`, the payload views); fp16 or bf16, `params` is updated in place, a push is decoded into
    `decoded` (float32 (P + B,)) and the replies are encoded into `outbox`."""

    def __init__(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, lr_scale: np.ndarray | None = None,
                 buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, buffers)
        cfg = self.cfg
        P, B = params.size, self.buffers.size
        momentum = explicit_momentum(cfg.momentum, cfg.async_momentum, len(self.workers))
        self.optimizer = SGD(params, decay_mask, momentum, cfg.weight_decay, nesterov=cfg.nesterov and momentum > 0,
                             lr_scale=lr_scale, threads=cfg.server_threads)
        # --lookahead: the replies carry the weights K momentum-only updates ahead (DANA), not the master weights;
        # --update-rule dana-zero: one step ahead along the sum of the workers' momenta
        # (--update-rule auto: DANA-Zero with Gap-Aware from 2 workers)
        self.update_rule, self.gap_aware, self.update_rule_why = resolve_update_rule(cfg, len(self.workers))
        self.dana = (DanaZero(params, decay_mask * np.float32(cfg.weight_decay) if cfg.weight_decay else None,
                              momentum, self.workers, lr_scale) if self.update_rule == "dana-zero" else None)
        self.lookahead_k = steps = 1 if self.dana else lookahead_steps(cfg.lookahead, len(self.workers), cfg.overlap)
        self.lookahead = (LookAhead(P, momentum, steps, lr_scale, nesterov=cfg.nesterov) if steps and momentum
                          else None)
        self.decoded = None if self.wire == "fp32" else np.empty(P + B, np.float32)  # a 16-bit push, decoded
        # fp32 replies of the master weights themselves: the master weights live in the send buffers' payloads;
        # otherwise (16-bit wire, look-ahead) they stay in `params`, updated in place, and replies are written
        self.weights = ({w: self.outbox[w].payload[:P] for w in self.workers}
                        if self.wire == "fp32" and self.lookahead is None else {})
        self.reply_buf = np.empty(P, np.float32) if self.wire != "fp32" and self.lookahead else None
        self.pulled_buf = (np.empty(P, np.float32) if (cfg.dc_lambda or self.gap_aware) and self.wire != "fp32"
                           else None)  # DC-ASGD's and Gap-Aware's w_pulled, decoded
        # --dc-lambda: the weights worker w computed its push on are those of its last reply, in weights[w]
        self.compensation = DelayCompensation(P, cfg.dc_lambda, cfg.dc_adaptive) if cfg.dc_lambda else None
        self.staleness_lr = resolve_staleness_lr(cfg)
        rule = AsyncRule(self.optimizer, self.staleness_lr)  # the update; DC-ASGD corrects the gradient first
        self.rule = (self.dana if self.dana is not None else rule if self.compensation is None
                     else DelayCompensated(rule, self.compensation))
        if self.gap_aware:  # --gap-aware: the gradient divided by its gap first (DANA-GA with DANA-Zero)
            self.rule = GapPenalized(self.rule, GapAware(P), self.applied_velocity, lr_scale)

    # --- the loop's questions ---
    def warm_up(self) -> None:
        """The optimizer's compiled update, DANA-Zero's and Gap-Aware's, and the wire format's compiled codec (fp16)
        loaded now (`SGD.warm_up`, `DanaZero.warm_up`, `GapAware.warm_up`, `wire.warm_up`), not at the first
        push."""
        self.optimizer.warm_up()
        if self.dana is not None:  # (DANA-GA: DANA-Zero's pass does Gap-Aware's too)
            self.dana.warm_up(gap_aware=self.gap_aware)
        elif self.gap_aware:
            self.rule.gap.warm_up(lr_scale=self.rule.lr_scale is not None)
        warm_up_wire(self.wire)

    def begin(self) -> None:
        """Send the first weights: to every worker, or (--warm-start, not on a resume) to the first one only."""
        cfg = self.cfg
        workers = f"{len(self.workers)} worker{'s' * (len(self.workers) != 1)}"  # (the start lines say it)
        if cfg.async_momentum != "fixed" and self.shard == 0:  # said once, on the console and in the log's events
            momentum = float(self.optimizer.momentum)
            off = " (Nesterov off: it needs a momentum > 0)" if cfg.nesterov and not momentum else ""
            text = (f"the server's momentum is {momentum:g} (--momentum {cfg.momentum:g}, --async-momentum "
                    f"{cfg.async_momentum}, {workers}){off}")
            self.rec.event("momentum", text)
            print(f"mpiasgd: {text}", flush=True)
        if self.shard == 0 and cfg.staleness_lr == "auto" and cfg.nsync > 1 and len(self.workers) > 1:
            text = (f"--staleness-lr auto: inverse (nsync {cfg.nsync}, {workers}: each accumulated update scaled by "
                    "1/staleness, so the workers' updates average)")
            self.rec.event("staleness_lr", text)
            print(f"mpiasgd: {text}", flush=True)
        if self.shard == 0 and cfg.update_rule == "auto":  # the default says what it chose
            ga = " with Gap-Aware" if self.gap_aware else ""
            text = f"--update-rule auto: {self.update_rule}{ga} ({self.update_rule_why})"
            self.rec.event("update_rule", text)
            print(f"mpiasgd: {text}", flush=True)
        if self.dana is not None and self.shard == 0:
            text = (f"DANA-Zero: a momentum per worker ({len(self.workers)}), the replies w - lr * "
                    f"{self.lookahead.factor:.4g} * (the sum of the workers' momenta)")
            self.rec.event("lookahead", text)
            print(f"mpiasgd: {text}", flush=True)
        elif cfg.lookahead and self.shard == 0:  # what --lookahead resolved to, once
            steps = self.lookahead_k
            if self.lookahead is not None:
                text = (f"the replies look {steps:g} update{'s' * (steps != 1)} ahead (--lookahead {cfg.lookahead:g}, "
                        f"{workers}): w - lr * {self.lookahead.factor:.4g} * v")
            else:
                why = "the server's momentum is 0" if steps else "with 1 worker nothing is stale"
                text = f"--lookahead {cfg.lookahead:g} is off: {why}"
            self.rec.event("lookahead", text)
            print(f"mpiasgd: {text}", flush=True)
        if self.cfg.warm_start > 0 and len(self.workers) > 1 and self.rec.resumed is None:
            first = self.workers[0]
            self.started.add(first)
            self.send(first, Tag.WEIGHTS, step=0, initial=True)
            self.rec.event("warm_start", f"worker rank {first} trains alone for {self.cfg.warm_start:g} s", at=0.0)
        else:
            self.start_workers()

    def tick(self) -> None:
        self.rec.check_stop()
        late = any(w not in self.started and w not in self.absent for w in self.workers)
        if late and ((self.rec.now() >= self.cfg.warm_start and not self.rec.stop_reason) or self.settled()):
            self.start_workers()
        self.agreement.answer_finishing()
        if self.periodic.due():  # --eval-interval: the workers running now evaluate their next reply's weights
            self.periodic.ask([w for w in self.workers if w in self.started and w not in self.stopped])
        self.gate.tick()  # (ssp: a stop, or a worker that caught up, releases held replies)

    def lose_worker(self, w: int) -> None:
        """`Role.lose_worker`, and the rules that count the workers follow: DANA-Zero's sum of momenta loses the
        dead worker's (its past updates stay in the weights), `--lookahead -1` looks N - 2 updates ahead instead of
        N - 1, `--async-momentum workers` takes the momentum for one worker fewer."""
        super().lose_worker(w)
        if self.dana is not None:
            self.dana.drop(w)
        self.count_workers()

    def rejoin_worker(self, w: int) -> None:
        """(--respawn) Worker rank `w`, dropped, is back (a replacement): `Role.rejoin`, a zero momentum of its own
        (DANA-Zero), and the rules that count the workers count it again; its first weights (`join_worker`) carry
        flag RESUME (it continues the dead worker's step count and data position)."""
        self.rejoin(w)
        self.rejoined.add(w)
        if self.dana is not None:
            self.dana.add(w)
        self.count_workers()

    def count_workers(self) -> None:
        """The rules that count the workers, for those alive now: `--async-momentum workers` and `--lookahead -1`."""
        cfg, alive = self.cfg, len(self.workers) - len(self.lost)
        momentum = explicit_momentum(cfg.momentum, cfg.async_momentum, alive)
        if cfg.async_momentum != "fixed":
            self.optimizer.momentum = np.float32(momentum)
        if self.dana is None and self.lookahead is not None and cfg.lookahead < 0:
            steps = lookahead_steps(cfg.lookahead, alive, cfg.overlap)
            self.lookahead.factor = lookahead_factor(momentum, steps, cfg.nesterov)

    def applied_velocity(self, push: Any) -> np.ndarray | None:
        """(--gap-aware) The velocity the update of `push` just applied: the pushing worker's momentum (DANA-Zero),
        the server's (None without momentum)."""
        return self.dana.velocities[push.worker] if self.dana is not None else self.optimizer.velocity

    def velocity(self) -> np.ndarray | None:
        """The momentum a checkpoint keeps (DANA-Zero: the sum of the workers' momenta)."""
        return self.dana.total if self.dana is not None else self.optimizer.velocity

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        super().restore(ckpt)
        if self.dana is not None:
            self.dana.restore(ckpt.momentum)
            if self.shard == 0:
                ga = "; Gap-Aware's mean step starts again" if self.gap_aware else ""
                text = (f"resumed DANA-Zero: the checkpoint keeps the sum of the workers' momenta; each of the "
                        f"{len(self.workers)} workers starts from the sum / {len(self.workers)} (not bit-identical "
                        f"to an uninterrupted run){ga}")
                self.rec.event("resume_state", text, at=ckpt.log_time)  # (the clock starts later, at `begin`)
                print(f"mpiasgd: {text}", flush=True)
        elif self.optimizer.velocity is not None:
            self.optimizer.velocity[:] = ckpt.momentum

    # --- sends ---
    def local_lr(self) -> float:
        """The step size a worker's nsync local steps use: the schedule at the middle of its next round
        (K minibatches by each of the N workers ahead), so that warm-up does not start them at 0."""
        rec = self.rec
        ahead = 0.5 * self.cfg.nsync * self.cfg.batch_size * len(self.workers) / rec.num_train
        epoch = rec.epoch + ahead
        return self.schedule(epoch, fraction_done(rec.rule, epoch, self.counter.version, rec.train_time()))

    def send(self, w: int, tag: Tag, step: int, initial: bool = False) -> None:
        """Post the current weights to worker `w` from its send buffer (copied there unless they live there).

        The master weights move between the send buffers: an update writes them into the buffer of
        the worker it answers, so a reply costs no copy. A buffer is written only after its previous
        send completed; the master weights are only read while a send from their buffer is in flight.
        16-bit wire: the weights (and buffers) are encoded into the send buffer, every reply.
        """
        self.out[w].take(0)
        out = self.outbox[w]
        # --eval-interval: this reply asks for evaluation `number` of the weights it carries
        number = self.periodic.flag(w, self.counter.version) if tag == Tag.WEIGHTS and not initial else 0
        if self.lookahead is not None and tag == Tag.WEIGHTS and not number and not initial:
            # --lookahead: w - lr * lr_mult * c * v (then encoded, 16-bit wire); the weights a worker evaluates
            # (STOP, EVALUATE) and the first ones are the master weights themselves
            lr = self.schedule(self.rec.epoch, self.rec.fraction_done())
            ahead = self.lookahead.reply(self.params, self.velocity(), lr,
                                         out.payload[:self.P] if self.reply_buf is None else self.reply_buf)
            if self.reply_buf is not None:
                self.encode_reply(ahead, out.payload[:self.P], w, tag, step, "weight (looking ahead)")
        elif self.wire != "fp32":  # 16-bit wire: the float32 master weights encoded into the send buffer
            self.encode_reply(self.params, out.payload[:self.P], w, tag, step, "weight", initial)
        elif self.weights.get(w) is not self.params:  # (look-ahead: the master weights live in `params`)
            out.payload[:self.P] = self.params
        if self.buffers.size:  # the mean buffers go with weights the worker evaluates (STOP, EVALUATE)
            self.encode_reply(self.current_buffers() if initial or tag == Tag.STOP or number else self.buffers,
                              out.payload[self.P:], w, tag, step, "layer buffer value", initial)  # (fp32: a copy)
        flags = Flag.PREEMPT if tag == Tag.STOP and self.r0.stops_on_signal else 0
        if initial and (self.rec.resumed is not None or w in self.rejoined):  # the worker continues its step count
            flags |= Flag.RESUME  # and data position (a resumed run; --respawn: the dead worker's)
        if number:
            flags |= Flag.EVALUATE
        self.tell_losses(w)
        out.stamp(tag, self.rank, step=step, version=self.counter.version, flags=flags, cursor=self.cursor[w],
                  elapsed=self.rec.train_time(), lr=self.local_lr() if self.cfg.nsync > 1 else 0.0, epoch=number)
        self.post(w, out, tag)
        self.rec.count_wire(pulled=out.buf.nbytes)

    def start_workers(self) -> None:
        """Send the first weights to every worker not started yet (at start-up, or when the warm start ends)."""
        rec = self.rec
        late = [w for w in self.workers if w not in self.started and w not in self.absent]
        if self.started:
            text = (f"the run stopped before the warm start ended: workers {late} never trained" if rec.stop_reason
                    else f"the other workers start at version {self.counter.version}")
            rec.event("warm_start_end", text)
            if rec.stop_reason and self.shard == 0:
                print(f"mpiasgd: warning: {text} (--warm-start {self.cfg.warm_start:g} s)", file=sys.stderr,
                      flush=True)
        self.gate.on_start(late)  # (ssp: their clocks start at the slowest's)
        for w in late:
            self.start(w)

    def start(self, w: int) -> None:
        """Worker `w`'s first weights (STOP once the run has stopped: it evaluates the final ones)."""
        self.started.add(w)
        self.r0.last_seen[w] = self.rec.now()
        self.send(w, Tag.STOP if self.rec.stop_reason else Tag.WEIGHTS, step=self.last_step[w], initial=True)
        if self.rec.stop_reason:
            self.stopped.add(w)
            self.periodic.withdraw(w)

    def join_worker(self, w: int) -> None:
        """(`mpiasgd simulate --join`) Worker `w`, absent so far, joins now: it gets the weights of this version
        (its staleness counts from this pull; ssp: its clock starts at the slowest's)."""
        self.absent.discard(w)
        self.gate.on_start([w])
        self.start(w)

    # --- a push ---
    def check_push(self, w: int, msg: Message) -> tuple[int, int]:
        """(step, base version) of a PUSH from worker `w`, after the protocol's checks (`Role.check_push`) and
        this one: it carries a gradient with nsync 1, an accumulated update (flag DELTA) with nsync > 1."""
        step, base = super().check_push(w, msg)
        delta = bool(int(msg.header["flags"]) & Flag.DELTA)
        if delta != (self.cfg.nsync > 1):
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} carries "
                                f"{'an accumulated update' if delta else 'a gradient'}, but nsync is "
                                f"{self.cfg.nsync} (expected {'an update' if self.cfg.nsync > 1 else 'a gradient'})")
        return step, base

    def update_target(self, w: int) -> np.ndarray:
        """fp32: the new weights go straight into worker `w`'s send buffer (its previous send has completed: w
        pushed after receiving it), which then holds the master weights until the next update; 16-bit wire and
        look-ahead: into `params`, in place."""
        self.out[w].take(0)
        return self.weights.get(w, self.params)

    def pulled(self, w: int) -> np.ndarray | None:
        """(DC-ASGD, Gap-Aware; None without them) The weights worker `w` computed its push on (float32 (P,)):
        those of its last reply, in its send buffer (fp32: a view; 16-bit wire: decoded, as the worker did, into a
        buffer of its own)."""
        if self.compensation is None and not self.gap_aware:
            return None
        if self.wire == "fp32":
            return self.outbox[w].payload[:self.P]
        return decode(self.wire, self.outbox[w].payload[:self.P], self.pulled_buf)


class AsgdWorker(ShardedWorker):
    """(workers) Push gradients (or nsync-step updates) and pull weights until rank 0 says STOP."""

    def compute_round(self, local: LocalSGD | None, pulled: Any, lr: float,
                      after_minibatch: Callable[[], bool]) -> tuple[float, int, int, int]:
        """One push's work on the bound weights and grads (GPU A-SGD's nsync, Paine et al. 2013): nsync 1, the
        gradient of one minibatch; nsync > 1 (`local` steps at `lr`), nsync local steps, after which the grads
        hold the accumulated update, the weights now minus `pulled` (a (P,) float32 array this copies the
        weights at the start of the round into). `after_minibatch()` is called after every minibatch (and
        its local step); True ends the round early (a signal, --max-time), the push carrying what it has.
        Returns (mean loss over the round's samples, correct, samples, epoch of the last minibatch). The
        real worker (`train`) and the simulator's virtual workers (`mpiasgd.sim.engine`) both compute here."""
        model = self.model
        if local is not None:
            pulled[...] = model.params
        tally, epoch = LossTally(), 0
        for _ in range(self.cfg.nsync):
            stats, batch_samples, epoch = self.gradient()
            tally.add(stats, batch_samples)
            if local is not None:
                local.step(lr)
            if after_minibatch():
                break
        if local is not None:  # the accumulated update: the weights now minus the weights at the start
            model.grads[...] = model.params
            model.grads -= pulled
        loss, correct, samples = tally.totals()  # (a GPU: the round's kernels are queued; this waits for them)
        return loss / samples, correct, samples, epoch

    def train(self) -> None:
        if self.cfg.servers > 1:
            self.train_sharded()
            return
        cfg, model, rank = self.cfg, self.model, self.rank
        ops = model.ops
        # one staging, or two with --overlap: the weights of one reply are in use while the next arrives
        stagings = [self.staging, self.make_staging()] if cfg.overlap else [self.staging]
        n = len(stagings)
        # --overlap on a GPU: a reply's host->device copy runs on the copy stream beside the push's device->host
        # copy (`Staging.defer_landing`); `ready()` before the weights are read, `before_receive()` before MPI
        # receives into the staging again
        if cfg.overlap:
            for staging in stagings:
                staging.defer_landing()
        pushes = SendSlots(stagings, "push", rank, cfg.worker_timeout)  # slot (step % n) sends push `step`
        cur = 0  # the staging whose params hold the weights in use
        request = self.comm.Irecv(stagings[cur].recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, wait_s = self.receive_weights(request, stagings[cur], "initial weights from the parameter server "
                                           "(rank 0)", timeout=cfg.worker_timeout + cfg.warm_start, initial=True)
        stagings[cur].ready()
        self.buffers_from(stagings[cur].params)  # rank 0's buffers to start from; this worker's own after
        began = time.perf_counter() - self.elapsed
        local = LocalSGD(model, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov) if cfg.nsync > 1 else None
        pulled = ops.empty(model.num_params) if local else None  # the weights at the start of this round
        reply = None  # --overlap: (request, staging index) of the reply in flight
        comm_s = 0.0
        version = self.version  # the version of the weights in use
        bound = None
        while tag == Tag.WEIGHTS:
            lr = float(stagings[cur].weights.header["lr"])  # step size of local steps (nsync > 1)
            out = (self.step + 1) % n  # the staging whose send buffer takes this push
            t = time.perf_counter()
            pushes.take(out)
            stagings[cur].ready()  # (--overlap on a GPU: the kernels below wait for the reply's copy)
            t0 = time.perf_counter()
            comm_s += t0 - t
            if bound != (cur, out):
                self.bind(stagings[cur].params, stagings[out].grads)
                bound = (cur, out)
            pulled_header = stagings[cur].weights.header  # of the weights in use
            if int(pulled_header["flags"]) & Flag.EVALUATE:  # --eval-interval: these weights first (rank 0's buffers)
                self.evaluate_during_training(int(pulled_header["epoch"]), version, stagings[cur].params)
                t0 = time.perf_counter()  # the evaluation is no part of this push's compute time
            loss, correct, samples, epoch = self.compute_round(  # a signal, --max-time: push what it has
                local, pulled, lr, lambda: self.signalled() or bool(
                    cfg.max_time and time.perf_counter() - began >= cfg.max_time))
            self.buffers_into(stagings[out].grads)  # the push carries this worker's buffers after the gradient
            stagings[out].finish_compute()  # cupy: device sync point
            self.straggle(t0)
            t1 = time.perf_counter()
            if reply is not None:  # --overlap: the reply to the previous push, usually here already
                request, cur = reply
                reply = None
                tag, wait_s = self.receive_weights(request, stagings[cur], f"reply to push step {self.step} from "
                                                   "the parameter server (rank 0)")
                if tag == Tag.STOP:
                    break  # the gradient just computed is dropped: the server takes no push after STOP
            t2 = time.perf_counter()
            self.step += 1
            stagings[out].push.stamp(Tag.PUSH, rank, step=self.step, version=version, samples=samples, epoch=epoch,
                                     correct=correct, loss=loss, compute_s=t1 - t0, comm_s=comm_s,
                                     wait_s=wait_s, lr=lr, cursor=self.cursor, data_s=self.take_data_s(),
                                     flags=(Flag.DELTA if local is not None else 0)
                                     | (Flag.PREEMPT if self.signalled() else 0))
            stagings[out].before_send()  # cupy: gradient device->host (pinned) or header host->device (CUDA-aware)
            into = (cur + 1) % n  # --overlap: the reply lands in the staging not in use
            stagings[into].before_receive()
            request = self.comm.Irecv(stagings[into].recv_buf, source=0, tag=MPI.ANY_TAG)
            pushes.post(out, self.comm.Isend(stagings[out].send_buf, dest=0, tag=int(Tag.PUSH)))
            comm_s = time.perf_counter() - t2
            if cfg.overlap:
                reply = (request, into)
                version = self.version  # the weights now in use came with the reply received above
                continue
            tag, wait_s = self.receive_weights(
                request, stagings[into], f"reply to push step {self.step} from the parameter server (rank 0)")
            cur, version = into, self.version
        pushes.drain()
        stagings[cur].ready()
        if tag == Tag.STOP:  # the final weights, and rank 0's mean buffers: what the snapshot holds
            self.buffers_from(stagings[cur].params)
        self.bind(stagings[cur].params, stagings[cur].grads)

    # --- --servers S > 1: one message per shard each way ---
    def train_sharded(self) -> None:
        """The loop of `train` with S parameter-server shards (`mpiasgd.comms.shard_cut`): after each round the S
        pushes (the push to shard s carries its slice of the gradient and the version of shard s's slice it
        was computed from) are posted together, after the S receives of their replies, and the next round
        starts once all S replies arrived (--overlap: the next round runs on the weights at hand while the S
        replies are in flight, into a second ShardedStaging, as `train` does with one server). The replies'
        flags, step size and buffers come from shard 0 (rank 0). When one shard answers STOP, every shard that
        answered the same push with WEIGHTS is sent FINISH and answers with STOP and its final slice
        (`finish_shards`)."""
        cfg, model, rank = self.cfg, self.model, self.rank
        stagings = [self.staging, self.make_staging()] if cfg.overlap else [self.staging]  # ShardedStagings
        n = len(stagings)
        ranks = self.shard_ranks()
        S = len(ranks)
        pushes = SendSlots(list(range(n * S)), "push", rank, cfg.worker_timeout)  # slot out*S + s: to shard s
        versions = [-1] * S  # the version of each shard's slice last received
        cur = 0  # the staging whose params hold the weights in use
        tags, wait_s = self.receive_replies(self.post_replies(ranks, stagings[cur]), ranks, versions,
                                            "initial weights", cfg.worker_timeout + cfg.warm_start, initial=True,
                                            staging=stagings[cur])
        in_use = list(versions)  # the versions of the slices of the weights in use
        self.buffers_from(stagings[cur].params)  # rank 0's buffers to start from; this worker's own after
        began = time.perf_counter() - self.elapsed
        local = LocalSGD(model, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov) if cfg.nsync > 1 else None
        pulled = model.ops.empty(model.num_params) if local else None  # the weights at the start of this round
        reply = None  # --overlap: (the S receives, staging index) of the replies in flight
        comm_s = 0.0
        bound = None
        while Tag.STOP not in tags:
            head = stagings[cur].weights[0].header  # rank 0's: the step size, the flags
            lr = float(head["lr"])
            out = (self.step + 1) % n  # the staging whose send buffers take this push
            t = time.perf_counter()
            for s in range(S):
                pushes.take(out * S + s)
            t0 = time.perf_counter()
            comm_s += t0 - t
            if bound != (cur, out):
                self.bind(stagings[cur].params, stagings[out].grads)
                bound = (cur, out)
            if int(head["flags"]) & Flag.EVALUATE:  # --eval-interval: these weights first (rank 0's buffers)
                self.evaluate_during_training(int(head["epoch"]), in_use[0], stagings[cur].params)
                t0 = time.perf_counter()
            loss, correct, samples, epoch = self.compute_round(
                local, pulled, lr, lambda: self.signalled() or bool(
                    cfg.max_time and time.perf_counter() - began >= cfg.max_time))
            self.buffers_into(stagings[out].grads)
            stagings[out].finish_compute()  # cupy: device sync point
            self.straggle(t0)
            t1 = time.perf_counter()
            if reply is not None:  # --overlap: the replies to the previous push, usually here already
                receives, cur = reply
                reply = None
                tags, wait_s = self.receive_replies(receives, ranks, versions, f"reply to push step {self.step}",
                                                    staging=stagings[cur])
                if Tag.STOP in tags:
                    break  # the gradient just computed is dropped: no shard takes a push after its STOP
            t2 = time.perf_counter()
            self.step += 1
            flags = (Flag.DELTA if local is not None else 0) | (Flag.PREEMPT if self.signalled() else 0)
            data_s = self.take_data_s()
            for s in range(S):
                stagings[out].push[s].stamp(Tag.PUSH, rank, step=self.step, version=in_use[s], samples=samples,
                                            epoch=epoch, correct=correct, loss=loss, compute_s=t1 - t0,
                                            comm_s=comm_s, wait_s=wait_s, lr=lr, cursor=self.cursor, data_s=data_s,
                                            flags=flags)
            stagings[out].before_send()  # each slice of the gradient into its shard's push (encoded: 16-bit
            # wire); every push flagged NONFINITE when any value of the whole one is not finite (every shard rejects)
            into = (cur + 1) % n  # --overlap: the replies land in the staging not in use
            receives = self.post_exchange(pushes, ranks, stagings[out], stagings[into], out * S)
            comm_s = time.perf_counter() - t2
            if cfg.overlap:
                reply = (receives, into)
                in_use = list(versions)  # the weights now in use came with the replies received above
                continue
            tags, wait_s = self.receive_replies(receives, ranks, versions, f"reply to push step {self.step}",
                                                staging=stagings[into])
            cur, in_use = into, list(versions)
        pushes.drain()
        self.finish_shards(tags, ranks, versions, stagings[cur])
        self.buffers_from(stagings[cur].params)  # the final weights, and rank 0's mean buffers: the snapshot's
        self.bind(stagings[cur].params, stagings[cur].grads)


class AsgdMode(Mode):
    name = "async"
    asynchronous = True
    elastic = True

    def check_config(self, cfg: Config) -> None:
        need(cfg.nsync >= 1, cfg, "nsync", "an integer >= 1")
        need(math.isfinite(cfg.warm_start) and cfg.warm_start >= 0, cfg, "warm_start", "seconds >= 0")
        need(cfg.staleness_lr in STALENESS_LR, cfg, "staleness_lr", f"one of {STALENESS_LR}")
        need(cfg.async_momentum in ASYNC_MOMENTUM, cfg, "async_momentum", f"one of {ASYNC_MOMENTUM}")
        need(cfg.async_momentum == "fixed" or cfg.nsync == 1, cfg, "async_momentum", "'fixed' with nsync > 1 (the "
             "server then adds updates without momentum; the workers' local steps are not asynchronous)")
        need(0 <= cfg.dc_lambda <= 1e6, cfg, "dc_lambda", "a number from 0 to 1e6 (0 = off)")
        need(0 <= cfg.dc_adaptive < 1, cfg, "dc_adaptive", "a decay 0 <= m < 1 (0 = a constant lambda)")
        need(not cfg.dc_adaptive or cfg.dc_lambda > 0, cfg, "dc_adaptive", "0 without --dc-lambda (it adapts lambda)")
        need(cfg.servers >= 1, cfg, "servers", "an integer >= 1 (parameter-server shards)")
        need(1 <= cfg.server_threads <= 1024, cfg, "server_threads", "an integer from 1 to 1024")
        need(cfg.update_rule in UPDATE_RULES, cfg, "update_rule", f"one of {UPDATE_RULES}")
        need(cfg.min_workers >= 1, cfg, "min_workers", "an integer >= 1 (workers left for a run to go on)")
        need(not cfg.respawn or cfg.servers == 1, cfg, "respawn", "False with --servers > 1 (a replacement worker "
             "talks to one parameter server)")
        need(not cfg.attach or cfg.servers == 1, cfg, "attach", "False with --servers > 1 (an attached worker talks "
             "to one parameter server)")
        if cfg.update_rule == "dana-zero":  # its momentum per worker and its own look-ahead replace these
            for key, ok, expected in dana_conflicts(cfg):
                need(ok, cfg, key, expected)
        need(cfg.lookahead == -1 or 0 <= cfg.lookahead <= 1e3, cfg, "lookahead", "updates from 0 (off) to 1000, or "
             "-1 (auto: N - 1, 2N - 1 with --overlap)")
        if cfg.lookahead:
            need(cfg.momentum > 0, cfg, "lookahead", "0 with momentum 0 (the reply looks ahead along the momentum)")
            need(cfg.nsync == 1, cfg, "lookahead", "0 with nsync > 1 (the server adds accumulated updates without "
                 "momentum: there is nothing to look ahead along)")
        need(cfg.wire in WIRES, cfg, "wire", f"one of {WIRES}")
        need(not cfg.wire_error_feedback or cfg.wire != "fp32", cfg, "wire_error_feedback",
             "False with --wire fp32 (error feedback carries what a 16-bit wire format rounds away: --wire fp16 "
             "or bf16)")
        if cfg.gap_aware:  # (as DC-ASGD: the gap is from the weights of the worker's last reply)
            need(cfg.nsync == 1, cfg, "gap_aware", "False with nsync > 1 (Gap-Aware penalizes a gradient; an nsync "
                 "push is an accumulated update)")
            need(not cfg.overlap, cfg, "gap_aware", "False with --overlap (a push is then computed on the weights of "
                 "the reply before the last, which the server no longer holds)")
            need(not cfg.dc_lambda, cfg, "gap_aware", "False with --dc-lambda (one answer to a stale gradient at a "
                 "time)")
        if cfg.dc_lambda:  # the server has the weights a push was computed on only for one gradient per reply
            need(cfg.nsync == 1, cfg, "dc_lambda", "0 with nsync > 1 (delay compensation corrects a gradient; "
                 "an nsync push is an accumulated update)")
            need(not cfg.overlap, cfg, "dc_lambda", "0 with --overlap (a push is then computed on the weights of "
                 "the reply before the last, which the server no longer holds)")

    def layout(self, cfg: Config, model: Any, num_workers: int, num_train: int) -> Any:
        if cfg.nsync > 1:
            round_fits(cfg, "nsync", cfg.nsync, num_workers, num_train)
        return super().layout(cfg, model, num_workers, num_train)

    server = AsgdServer  # the rank-0 role: a variant with another update rule subclasses it and sets `rule`

    def gate(self, server: AsgdServer) -> Any:
        """When `server` answers a push: at once (`ReplyNow`); ssp: once the staleness bound allows."""
        return ReplyNow(server)

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Any) -> AsgdServer:
        """The parameter server of rank `r0.rank`: the whole vector, or (--servers S) the shard that rank holds,
        on its slice of `params`, `decay_mask` and the learning-rate multipliers, with the layer buffers on
        shard 0 only (`mpiasgd.comms.shard_cut`)."""
        scale, buffers = lr_scale(model), initial_buffers(model)
        cut, s = server_shard(r0, params.size, buffers)
        a, b = cut.slice(s)
        server = self.server(r0, params[a:b], decay_mask[a:b], None if scale is None else scale[a:b],
                             buffers if s == 0 else None)
        server.place(cut, s, self.gate(server))
        return server

    def worker(self, job: WorkerJob) -> AsgdWorker:
        return AsgdWorker(job)


MODE = AsgdMode()
