"""Decoupled parallel backpropagation with data parallelism (`--mode pipeline`).

Pham and Ahn, "Distributed Deep Learning using Stochastic Gradient Staleness" (arXiv 2509.05679):
the model's layer list is cut into K modules; N replicas of the whole pipeline train on disjoint
data shards. Ranks 1..N*K form an N x K grid, rank 1 + n*K + k holding module k of replica n, with
one pipeline communicator per replica (along k) and one data communicator per module (along n).
Rank 0 only logs (REPORT, SNAPSHOT), as in sync mode.

Every iteration t, every unit works without waiting for a full forward and backward pass:

    forward   the newest minibatch: module 0 reads minibatch t, module k > 0 takes the activation
              module k-1 sent; the output goes to module k+1 (non-blocking ACTIVATION). The last
              module computes the loss and its backward at once.
    backward  an older minibatch, with the output gradient module k+1 sent back (GRADIENT): the
              module re-runs its forward on the input it stored for that minibatch, back-propagates,
              sends the input gradient to module k-1, and updates its weights.

    decoupling "full" (FDG, Zhuang et al. 2021; the default):  forward of minibatch t - k at module
        k, which therefore updates with a gradient 2(K-1-k) iterations old (every message is
        consumed one iteration after it was sent: all K modules compute at the same time).
    decoupling "backward" (DDG, Huo et al. 2018):  the forward pass stays locked (minibatch t flows
        through every module within iteration t); only the backward is decoupled: delay K-1-k.

A module keeps exactly the inputs its delay needs (a queue of delay + 1 minibatches; with
`--weight-stashing` also the weights each forward used, PipeDream's rule, which the backward then
uses instead of the current weights). The first iterations of a module have no gradient yet
(warm-up, logged with flag WARMUP). `--shrink beta` multiplies the input gradient a module sends
back, so module k's gradient is scaled by beta^(K-1-k) (FDG's gradient shrinking). Replicas of a
module average their gradients every iteration (allreduce on the data communicator) and apply the
same SGD step, so they stay identical (every REPORT carries a CRC-32 of the module's weights, and
rank 0 stops the run at the first iteration where two replicas differ). At the end every module
drains: minibatches already started are back-propagated through every module, so each minibatch's
gradient is applied exactly once by every module.

With K = 1 this is synchronous data parallelism exactly (`--mode sync`: same shards, order, schedule).

Step size. The convergence result for SGD with delayed gradients of bounded delay tau (e.g. Lian
et al. 2015, Theorem 1; FDG, Theorem 1; Pham and Ahn 2025 for this combination) needs an L-smooth
loss and a step size small against the delay: gamma_t L (1 + 2 tau) <= 1 in the form implemented
here, with tau = 2(K-1) (full) or K-1 (backward) the largest module delay, and sum gamma_t =
infinity, sum gamma_t^2 < infinity for convergence to a critical point; a constant step gives a
neighbourhood of size O(gamma). We apply the same schedule (`--lr`, warm-up, cosine/step) to every
module; deeper pipelines want a smaller `--lr` or `--shrink`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import protocol, signals
from mpiasgd.checkpoint import batch_rng
from mpiasgd.comms import wait
from mpiasgd.config import Config, ConfigError
from mpiasgd.data import Dataset, ShardSampler
from mpiasgd.evaluate import evaluate
from mpiasgd.optim import finite_square, fraction_done, learning_rate
from mpiasgd.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.server import ParameterServer
from mpiasgd.worker import LocalSGD, minibatches

# ----------------------------------------------------------------------------------------------
# cutting the layer list


def layer_costs(model: Any, balance: str) -> list[float]:
    """Per-layer cost for balancing: forward work ("flops") or parameter count ("params").

    "flops": 2 x multiply-adds of conv/linear layers plus one operation per output element, so
    layers without weights (ReLU, pooling) are not free. "params": the parameter count, plus 1e-6
    per output element only to break ties between cuts.
    """
    outputs = [int(np.prod(s)) for s in model.shapes]
    if balance == "params":
        sizes = [model.param_range(i, i + 1) for i in range(len(model.layers))]
        return [float(stop - start) + 1e-6 * out for (start, stop), out in zip(sizes, outputs, strict=True)]
    return [float(f + out) for f, out in zip(model.layer_flops(), outputs, strict=True)]


def partition(model: Any, modules: int, cuts: tuple[int, ...] = (), balance: str = "flops") -> list[int]:
    """Module boundaries [0, c_1, ..., c_{K-1}, L]: module k is layers bounds[k]..bounds[k+1]-1.

    `cuts` given: used as they are (ConfigError if out of range). Otherwise the K-1 cuts that
    minimise the largest module cost (`layer_costs`), by dynamic programming over the L layers.
    """
    count = len(model.layers)
    if modules > count:
        raise ConfigError(f"config key 'modules' = {modules}: model '{model.name}' has only {count} layers")
    if cuts:
        if len(cuts) != modules - 1 or cuts[-1] >= count:
            raise ConfigError(f"config key 'cuts' = {','.join(map(str, cuts))!r}: expected {modules - 1} increasing "
                              f"layer index(es) in 1..{count - 1} for model '{model.name}' ({count} layers)")
        return [0, *cuts, count]
    costs = layer_costs(model, balance)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # best[j][i]: the smallest max-module cost of layers 0..i-1 in j modules; split[j][i]: its last cut
    best = np.full((modules + 1, count + 1), np.inf)
    split = np.zeros((modules + 1, count + 1), dtype=int)
    best[0][0] = 0.0
    for j in range(1, modules + 1):
        for i in range(j, count + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], split[j][i] = value, c
    bounds, i = [count], count
    for j in range(modules, 0, -1):
        i = int(split[j][i])
        bounds.append(i)
    return bounds[::-1]


def describe_partition(model: Any, bounds: list[int], balance: str, decoupling: str = "full") -> str:
    """One line per module: its layers, parameters, share of the balanced cost, and delay in iterations."""
    costs = layer_costs(model, balance)
    total = sum(costs) or 1.0
    what = "forward work" if balance == "flops" else "parameters"
    K = len(bounds) - 1
    delay = [(2 if decoupling == "full" else 1) * (K - 1 - k) for k in range(K)]
    lines = []
    for k in range(len(bounds) - 1):
        first, last = bounds[k], bounds[k + 1]
        start, stop = model.param_range(first, last)
        share = sum(costs[first:last]) / total
        lines.append(f"  module {k}: layers {first}..{last - 1} ({', '.join(model.names[first:last])}), "
                     f"{stop - start:,} parameters, {share:.0%} of the {what}, delay {delay[k]}")
    return "\n".join(lines)


class Module:
    """Layers first..last-1 of `model` with their parameters in one module-local flat vector.

    `params`/`grads` (float32 (size,), on the model's backend) are the slice [start, stop) of the
    whole model's vectors. forward(x (B, *in_shape)) -> (B, *out_shape); backward(dy) -> dx, or None
    for module 0 (nothing consumes the gradient w.r.t. the images).
    """

    def __init__(self, model: Any, first: int, last: int) -> None:
        self.model, self.first, self.last = model, first, last
        self.layers = model.layers[first:last]
        self.start, self.stop = model.param_range(first, last)
        self.size = self.stop - self.start
        self.in_shape = tuple(model.input_shape if first == 0 else model.shapes[first - 1])
        self.out_shape = tuple(model.shapes[last - 1])
        self.is_last = last == len(model.layers)
        ops = model.ops
        self.params, self.grads = ops.zeros(self.size), ops.zeros(self.size)
        self.bind(self.params)

    def bind(self, params: Any) -> None:
        """Compute with `params` (the current weights, or a stashed copy); gradients go to `grads`."""
        self.model.bind_layers(self.first, self.last, params, self.grads)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy: Any) -> Any:
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy

    def loss_backward(self, logits: Any, labels: Any) -> tuple[float, int, Any]:
        """(last module) loss of `logits`, then backward: (mean loss, correct, dx)."""
        loss, correct = self.model.loss.forward(logits, labels)
        return loss, correct, self.backward(self.model.loss.backward())


# ----------------------------------------------------------------------------------------------
# a unit: module k of replica n


class PipelineUnit:
    """(all workers, pipeline mode) Module k of replica n; see the module docstring.

    `pipe` is the replica's pipeline communicator (rank k), `data` the module's data communicator
    (rank n); `comm` reaches rank 0. `sampler` is the replica's shard; `bounds` the module cuts.
    """

    def __init__(self, comm: Any, cfg: Config, model: Any, dataset: Dataset, sampler: ShardSampler, rank: int,
                 pipe: Any, data: Any, bounds: list[int]) -> None:
        self.comm, self.cfg, self.dataset, self.rank = comm, cfg, dataset, rank
        self.pipe, self.data = pipe, data
        self.k, self.K = pipe.Get_rank(), pipe.Get_size()
        self.n, self.N = data.Get_rank(), data.Get_size()
        self.module = Module(model, bounds[self.k], bounds[self.k + 1])
        self.ops = model.ops
        self.sampler = sampler
        self.num_train = dataset.train_y.size
        self.full = cfg.decoupling == "full"
        self.delay = (2 if self.full else 1) * (self.K - 1 - self.k)
        self.sending: dict[str, list[Any]] = {}
        self.slowdown = cfg.stragglers().get(rank, 1.0)  # --straggler: compute time multiplier of this unit
        self.preempted = False

    def forward_minibatch(self, t: int) -> int:
        """The minibatch (counted from the segment's first) whose forward this unit runs at iteration t."""
        return t - self.k if self.full else t

    def post(self, kind: str, slot: int, request: Any) -> None:
        self.sending.setdefault(kind, [None, None])[slot] = request

    def free(self, kind: str, slot: int, what: str) -> None:
        """Complete the send that last used buffer `slot` of `kind` before it is written again."""
        wait(self.sending.get(kind, [None, None])[slot], what, self.rank, self.cfg.worker_timeout)

    def receive(self, request: Any, msg: Message, tag: Tag, source: int, m: int, what: str) -> float:
        """Wait for an ACTIVATION/GRADIENT of minibatch `m`; checks; returns seconds waited."""
        status = MPI.Status()
        waited = wait(request, what, self.rank, self.cfg.worker_timeout, status)
        protocol.check_size(tag, source, self.rank, status.Get_count(MPI.BYTE), msg.count)
        protocol.check(msg, tag, status.Get_source(), self.rank)
        if int(msg.header["step"]) != m:
            raise ProtocolError(f"rank {self.rank}: {tag.name} for minibatch {int(msg.header['step'])} from "
                                f"module {source}, expected minibatch {m}")
        return waited

    def run(self) -> bool:
        """Train in segments until the run stops; returns True if a signal ended it (preempted).

        A segment ends with a drain: module 0 stops starting minibatches, every started one is
        back-propagated through every module, and replica 0 sends rank 0 each module's weights and
        velocity (CHECKPOINT). The state after a drain is complete (no minibatch in flight), so a run
        resumed from it continues exactly as the uninterrupted run did after the same drain.
        Segments end at the stopping rule, on a signal, and every --checkpoint-interval seconds.
        """
        cfg, ops, module, k, rank = self.cfg, self.ops, self.module, self.k, self.rank
        B = cfg.batch_size
        self.in_count = B * int(np.prod(module.in_shape))
        self.out_count = B * int(np.prod(module.out_shape))
        # initial weights: this module's slice, from rank 0 (a resumed run: then the velocity)
        start = Message(module.size)
        wait(self.comm.Irecv(start.buf, source=0, tag=int(Tag.WEIGHTS)), "initial weights from rank 0", rank,
             cfg.worker_timeout)
        protocol.check(start, Tag.WEIGHTS, 0, rank)
        module.params[...] = ops.asarray(start.payload)
        self.local = LocalSGD(module.model, cfg, module.start, module.stop)
        h = start.header
        base, t_base, elapsed = 0, 0, 0.0  # minibatches and iterations done, seconds trained
        if int(h["flags"]) & Flag.RESUME:
            base, t_base, elapsed = int(h["cursor"]), int(h["step"]), float(h["elapsed"])
            state = Message(module.size)
            wait(self.comm.Irecv(state.buf, source=0, tag=int(Tag.CHECKPOINT)), "the checkpoint's velocity from "
                 "rank 0", rank, cfg.worker_timeout)
            protocol.check(state, Tag.CHECKPOINT, 0, rank)
            self.local.velocity[...] = ops.asarray(state.payload)
        self.acts_in = [Message(self.in_count), Message(self.in_count)] if k > 0 else None
        self.acts_out = [Message(self.out_count), Message(self.out_count)] if k < self.K - 1 else None
        self.grads_in = [Message(self.out_count), Message(self.out_count)] if k < self.K - 1 else None
        self.grads_out = [Message(self.in_count), Message(self.in_count)] if k > 0 else None
        self.reports = [Message(0), Message(0)]
        self.snap = Message(module.size) if self.n == 0 else None
        self.ckpt = Message(2 * module.size) if self.n == 0 else None
        # module 0 hears of a signal on rank 0 (or on another unit) by a STOP; the last STOP ends the run
        self.stop = Message(0) if k == 0 else None
        self.stop_req = self.comm.Irecv(self.stop.buf, source=0, tag=int(Tag.STOP)) if k == 0 else None
        self.batches = minibatches(self.sampler, B, base)   # module 0: images; the last module: labels
        self.labels = minibatches(self.sampler, B, base) if module.is_last and k > 0 else self.batches
        self.began = time.perf_counter() - elapsed
        self.last_checkpoint = elapsed
        final = False
        while not final:
            base, t_base, final = self.segment(base, t_base)
        for kind, requests in self.sending.items():
            for req in requests:
                wait(req, f"completion of the last {kind} sends", rank, cfg.worker_timeout)
        if k == 0:
            wait(self.stop_req, "STOP from rank 0 after the last iteration", rank, cfg.worker_timeout)
        return self.preempted

    def segment(self, base: int, t_base: int) -> tuple[int, int, bool]:
        """Iterations from minibatch `base` (the first of the segment) until the drain; the unit's
        iterations so far are `t_base`. Returns (minibatches done, iterations done, the run ended)."""
        cfg, ops, module, k, K, rank = self.cfg, self.ops, self.module, self.k, self.K, self.rank
        B = cfg.batch_size
        local, stored = self.local, deque()  # stored: (minibatch, input, stashed weights or None), <= delay + 1
        acts_in, acts_out, grads_in, grads_out = self.acts_in, self.acts_out, self.grads_in, self.grads_out
        act_req = self.pipe.Irecv(acts_in[base % 2].buf, source=k - 1, tag=int(Tag.ACTIVATION)) if k > 0 else None
        grad_req = (self.pipe.Irecv(grads_in[base % 2].buf, source=k + 1, tag=int(Tag.GRADIENT))
                    if k < K - 1 else None)
        ctrl = np.zeros(3, dtype=np.float64)     # [elapsed seconds, preempt, halt], max over the module's replicas
        last_snapshot, snapshot_at = ctrl[0], -1  # the iteration after which replica 0 sends a snapshot
        total = None                             # minibatches done at the segment's end, once module 0 decided
        ending = 0                               # Flag bits of the end: FINAL (the run ends), PREEMPT (on a signal)
        t = 0
        while True:
            t0 = time.perf_counter()
            wait_s = comm_s = 0.0
            # a STOP from rank 0: a signal there (flag PREEMPT), or --on-divergence stop (halt: the run ends
            # as at the stopping rule, with the final evaluation)
            stopped = self.stop_req is not None and bool(self.stop_req.Test())
            halt = stopped and not int(self.stop.header["flags"]) & Flag.PREEMPT
            signal = bool(signals.received()) or (stopped and not halt)
            ctrl[:] = t0 - self.began, float(signal), float(halt)
            if self.N > 1:  # one clock for the replicas: the same schedule and stopping decision
                wait_s += wait(self.data.Iallreduce(MPI.IN_PLACE, ctrl, op=MPI.MAX), "the control allreduce",
                               rank, cfg.worker_timeout)
            m_f = base + self.forward_minibatch(t)
            m_b = m_f - self.delay
            flags, loss, correct = Flag.PREEMPT if signal else 0, 0.0, 0
            # --- forward of the newest minibatch
            if m_f >= base and (total is None or m_f < total):
                if k == 0:
                    _, idx = next(self.batches)
                    x, y = self.dataset.batch("train", idx, batch_rng(cfg.seed, 1 + self.n, m_f))
                    x = ops.asarray(x)
                    if total is None:  # module 0 decides where the segment ends, on the replicas' clock
                        if ctrl[1]:
                            ending = Flag.FINAL | Flag.PREEMPT
                        elif ctrl[2] or self.stopping(m_f + 1, ctrl[0]):
                            ending = Flag.FINAL
                        elif cfg.checkpoint_interval and ctrl[0] - self.last_checkpoint >= cfg.checkpoint_interval:
                            ending = Flag.LAST
                        if ending:
                            total = m_f + 1
                            self.last_checkpoint = ctrl[0]
                            if ending & Flag.FINAL:  # rank 0 logs the stop now (and why); the drain follows
                                flags |= Flag.LAST | (ending & Flag.PREEMPT)
                    if (self.n == 0 and cfg.snapshot_interval and snapshot_at < t and total is None
                            and ctrl[0] - last_snapshot >= cfg.snapshot_interval):
                        # every module has heard of it by then (full: module k at t + k; backward: at t)
                        last_snapshot, snapshot_at = ctrl[0], t + (K - 1 if self.full else 0)
                else:
                    msg = acts_in[m_f % 2]
                    wait_s += self.receive(act_req, msg, Tag.ACTIVATION, k - 1, m_f,
                                           f"activation of minibatch {m_f} from module {k - 1}")
                    if int(msg.header["flags"]) & Flag.LAST:  # the segment's last minibatch; how it ends
                        total = m_f + 1
                        ending = int(msg.header["flags"]) & (Flag.LAST | Flag.FINAL | Flag.PREEMPT)
                    snapshot_at = max(snapshot_at, int(msg.header["version"]))
                    x = ops.asarray(np.array(msg.payload.reshape(B, *module.in_shape)))  # a copy: the buffer is reused
                    act_req = None
                    if total is None:  # the next activation lands in the other buffer
                        act_req = self.pipe.Irecv(acts_in[(m_f + 1) % 2].buf, source=k - 1, tag=int(Tag.ACTIVATION))
                h = module.forward(x)
                if module.is_last:  # loss and backward at once: delay 0
                    y = self.dataset.train_y[next(self.labels)[1]] if k > 0 else y
                    loss, correct, dx = module.loss_backward(h, ops.asarray(y, y.dtype))
                else:
                    out = acts_out[m_f % 2]
                    self.free("act", m_f % 2, "completion of an activation send")
                    out.payload[:] = ops.to_numpy(h).ravel()
                    out.stamp(Tag.ACTIVATION, k, step=m_f, version=snapshot_at,
                              flags=(ending | Flag.LAST) if total == m_f + 1 else 0)
                    t1 = time.perf_counter()
                    self.post("act", m_f % 2, self.pipe.Isend(out.buf, dest=k + 1, tag=int(Tag.ACTIVATION)))
                    comm_s += time.perf_counter() - t1
                    stashed = ops.zeros(module.size) if cfg.weight_stashing else None
                    if stashed is not None:
                        stashed[...] = module.params
                    stored.append((m_f, x, stashed))
            # --- backward of an older minibatch, with the gradient module k+1 sent back
            applied = m_b >= base and (total is None or m_b < total)
            if applied and not module.is_last:
                msg = grads_in[m_b % 2]
                wait_s += self.receive(grad_req, msg, Tag.GRADIENT, k + 1, m_b,
                                       f"gradient of minibatch {m_b} from module {k + 1}")
                dy = ops.asarray(msg.payload.reshape(B, *module.out_shape))
                m, x, stashed = stored.popleft()
                if m != m_b:
                    raise ProtocolError(f"rank {rank}: stored input of minibatch {m}, backward of {m_b}")
                if stashed is not None:
                    module.bind(stashed)
                module.forward(x)  # rebuild the layer caches for this minibatch
                dx = module.backward(dy)
                if stashed is not None:
                    module.bind(module.params)
                grad_req = None
                if total is None or m_b + 1 < total:
                    grad_req = self.pipe.Irecv(grads_in[(m_b + 1) % 2].buf, source=k + 1, tag=int(Tag.GRADIENT))
            if applied and k > 0:  # send the input gradient back, shrunk by beta
                out = grads_out[m_b % 2]
                self.free("grad", m_b % 2, "completion of a gradient send")
                out.payload[:] = ops.to_numpy(dx).ravel()
                if cfg.shrink != 1.0:
                    out.payload *= np.float32(cfg.shrink)
                out.stamp(Tag.GRADIENT, k, step=m_b)
                t1 = time.perf_counter()
                self.post("grad", m_b % 2, self.pipe.Isend(out.buf, dest=k - 1, tag=int(Tag.GRADIENT)))
                comm_s += time.perf_counter() - t1
            lr = 0.0
            if applied:
                if self.N > 1:  # average the module gradient over the replicas
                    host = ops.to_numpy(module.grads)
                    wait_s += wait(self.data.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM), "the gradient allreduce",
                                   rank, cfg.worker_timeout)
                    module.grads[...] = ops.asarray(host)
                    module.grads *= np.float32(1.0 / self.N)
                if finite_square(module.grads)[0]:  # the same for every replica: after the allreduce
                    done = m_b * B * self.N / self.num_train
                    lr = learning_rate(cfg, done, fraction_done(cfg, done, m_b, ctrl[0]))
                    local.step(lr, module.params, module.grads)
                else:  # skipped by every replica of this module; rank 0 counts it (--max-rejects)
                    flags |= Flag.NONFINITE | Flag.WARMUP
            else:
                flags |= Flag.WARMUP
            if self.slowdown > 1:  # --straggler: emulate a unit `slowdown` times slower than this one
                busy = time.perf_counter() - t0 - wait_s - comm_s
                time.sleep((self.slowdown - 1) * busy)
            drained = total is not None and m_b == total - 1
            finished = drained and bool(ending & Flag.FINAL)
            if finished:
                flags |= Flag.END | (ending & Flag.PREEMPT)
                self.preempted = bool(ending & Flag.PREEMPT)
            self.report(t_base + t, m_f, m_b if applied else -1, flags, loss, correct, applied,
                        time.perf_counter() - t0 - wait_s - comm_s, comm_s, wait_s, lr)
            if self.n == 0 and (t == snapshot_at or finished):
                self.free("snap", 0, "completion of a SNAPSHOT send")
                self.snap.payload[:] = ops.to_numpy(module.params)
                # (cursor, step) = (the segment's first minibatch, the iteration in it): the same for every module
                self.snap.stamp(Tag.SNAPSHOT, rank, step=t, cursor=base, version=m_b + 1,
                                flags=Flag.FINAL if finished else 0)
                self.post("snap", 0, self.comm.Isend(self.snap.buf, dest=0, tag=int(Tag.SNAPSHOT)))
            if drained:
                if self.n == 0:
                    self.send_checkpoint(t_base + t + 1, total, ending, ctrl[0])
                return total, t_base + t + 1, finished
            t += 1

    def send_checkpoint(self, steps: int, total: int, ending: int, elapsed: float) -> None:
        """(replica 0, after a drain) This module's weights and velocity to rank 0, which writes the
        checkpoint once every module's has arrived: `steps` iterations and `total` minibatches done."""
        P = self.module.size
        self.free("ckpt", 0, "completion of a CHECKPOINT send")
        self.ckpt.payload[:P] = self.ops.to_numpy(self.module.params)
        self.ckpt.payload[P:] = self.ops.to_numpy(self.local.velocity)
        self.ckpt.stamp(Tag.CHECKPOINT, self.rank, step=steps, version=total, cursor=total, elapsed=elapsed,
                        flags=ending & (Flag.FINAL | Flag.PREEMPT))
        self.post("ckpt", 0, self.comm.Isend(self.ckpt.buf, dest=0, tag=int(Tag.CHECKPOINT)))

    def stopping(self, minibatches_done: int, elapsed: float) -> bool:
        """(module 0) The stopping rule after `minibatches_done` minibatches per replica."""
        cfg = self.cfg
        return bool((cfg.epochs and minibatches_done * cfg.batch_size * self.N >= cfg.epochs * self.num_train)
                    or (cfg.max_pushes and minibatches_done >= cfg.max_pushes)
                    or (cfg.max_time and elapsed >= cfg.max_time))

    def report(self, t: int, m_f: int, m_b: int, flags: int, loss: float, correct: int,
               applied: bool, compute_s: float, comm_s: float, wait_s: float, lr: float) -> None:
        """REPORT of iteration t to rank 0: version = the iteration whose forward the applied gradient used;
        digest = CRC-32 of the module's weights (N > 1: rank 0 checks that the replicas agree)."""
        reports, slot = self.reports, t % 2
        self.free("report", slot, "completion of a REPORT send")
        # samples: counted once per minibatch, by the last module (the pushes table sums them)
        samples = self.cfg.batch_size if applied and self.module.is_last else 0
        digest = protocol.weights_digest(self.ops.to_numpy(self.module.params)) if self.N > 1 else 0
        reports[slot].stamp(Tag.REPORT, self.rank, step=t, version=t - self.delay if m_b >= 0 else -1,
                            epoch=m_b, samples=samples, correct=correct, loss=loss, compute_s=compute_s,
                            comm_s=comm_s, wait_s=wait_s, lr=lr, flags=flags, digest=digest)
        self.post("report", slot, self.comm.Isend(reports[slot].buf, dest=0, tag=int(Tag.REPORT)))


# ----------------------------------------------------------------------------------------------
# rank 0


class PipelineMonitor(ParameterServer):
    """(server only, pipeline mode) Sends each unit its module's initial weights, logs every REPORT
    (pushes table: one row per unit per iteration, staleness = the module's delay), assembles the
    snapshots replica 0 sends into whole-model snapshots, and at the end evaluates the final
    weights on the test set itself (numpy). Never updates weights.

    `bounds` are the module cuts; `model` (numpy) and `dataset` are used for the final evaluation.
    Checkpoints: replica 0's units send their module's weights and velocity after every drain
    (CHECKPOINT); once all K have arrived for the same drain, rank 0 writes the file. A signal
    (here, or flagged in a unit's REPORT) becomes a STOP with flag PREEMPT to every module 0.
    """

    checkpoints_here = False

    def __init__(self, comm: Any, cfg: Config, params: np.ndarray, decay_mask: np.ndarray, num_workers: int,
                 num_train: int, log: Any, progress: Any, model: Any, dataset: Dataset, bounds: list[int]) -> None:
        super().__init__(comm, cfg, params, decay_mask, num_workers, num_train, log, progress)
        self.model, self.dataset, self.bounds = model, dataset, bounds
        self.K = len(bounds) - 1
        self.N = num_workers // self.K
        self.ranges = [model.param_range(bounds[k], bounds[k + 1]) for k in range(self.K)]
        self.inbox = {w: Message(self.size_of(w)) for w in self.workers}
        self.outbox = {}
        self.pieces: dict[tuple, set] = {}      # snapshot (segment, iteration) -> modules received
        self.ended: set[int] = set()
        self.final: set[int] = set()
        self.ckpt_params, self.ckpt_momentum = np.zeros_like(params), np.zeros_like(params)
        self.ckpt_pieces: dict[int, dict] = {}  # minibatches done at a drain -> {module: its steps}
        self.ckpt_inboxes: dict[int, Message] = {}
        self.final_checkpoint = False

    def module_of(self, w: int) -> int:
        return (w - 1) % self.K

    def size_of(self, w: int) -> int:
        start, stop = self.ranges[self.module_of(w)]
        return stop - start

    def handlers(self) -> dict:
        return {Tag.REPORT: self.on_report, Tag.SNAPSHOT: self.on_snapshot, Tag.CHECKPOINT: self.on_checkpoint}

    def buffer_for(self, tag: Tag, source: int) -> Message:
        if tag == Tag.CHECKPOINT:  # the module's weights and velocity
            if source not in self.ckpt_inboxes:
                self.ckpt_inboxes[source] = Message(2 * self.size_of(source))
            return self.ckpt_inboxes[source]
        return super().buffer_for(tag, source)

    def check_stop(self) -> None:
        pass  # decided by module 0; see on_report

    def begin(self) -> None:
        """Each unit's module slice; on a resume flagged RESUME (iterations, minibatches and seconds done),
        followed by the slice of the velocity (CHECKPOINT)."""
        ck = self.resumed
        for w in self.workers:
            start, stop = self.ranges[self.module_of(w)]
            out = Message(stop - start)
            out.payload[:] = self.params[start:stop]
            if ck is None:
                out.stamp(Tag.WEIGHTS, 0, version=0)
            else:
                out.stamp(Tag.WEIGHTS, 0, version=self.version, step=self.last_step[w], cursor=self.cursor[w],
                          elapsed=ck.elapsed, flags=Flag.RESUME)
                self.send_state(w, ck.momentum[start:stop])
            self.outbox[w] = out
            self.sending[w] = self.comm.Isend(out.buf, dest=w, tag=int(Tag.WEIGHTS))
        self.started = set(self.workers)

    def on_preempt(self) -> None:
        """Module 0 of every replica hears of it (STOP, flag PREEMPT) and ends the segment there."""
        self.stop_workers()

    def stop_workers(self) -> None:
        """A STOP to module 0 of every replica (flag PREEMPT on a signal; without it the run ends with the
        final evaluation, as at the stopping rule)."""
        for w in self.workers:
            if self.module_of(w) == 0:
                self.send_stop(w)

    def on_checkpoint(self, w: int, msg: Message) -> None:
        if w > self.K:
            raise ProtocolError(f"rank 0: CHECKPOINT from unit rank {w}; only replica 0 (ranks 1..{self.K}) "
                                f"sends them")
        h, k = msg.header, self.module_of(w)
        start, stop = self.ranges[k]
        total = int(h["version"])
        self.ckpt_params[start:stop] = msg.payload[: stop - start]
        self.ckpt_momentum[start:stop] = msg.payload[stop - start:]
        got = self.ckpt_pieces.setdefault(total, {})
        got[k] = int(h["step"])
        if len(got) < self.K:
            return
        del self.ckpt_pieces[total]
        flags = int(h["flags"])
        reason = "preempt" if flags & Flag.PREEMPT else "end" if flags & Flag.FINAL else "interval"
        steps = {u: (got[self.module_of(u)], total) for u in self.workers}
        ckpt = self.make_checkpoint(self.ckpt_params, self.ckpt_momentum, reason, steps, float(h["elapsed"]))
        ckpt.version, ckpt.samples = total, total * self.cfg.batch_size * self.N
        self.write_checkpoint(reason, ckpt)
        self.final_checkpoint = bool(flags & Flag.FINAL)

    def done(self) -> bool:
        return len(self.ended) == len(self.workers) and len(self.final) == self.K and self.final_checkpoint

    def waiting_for(self) -> list[int]:
        return [w for w in self.workers if w not in self.ended]

    def on_report(self, w: int, msg: Message) -> None:
        h = msg.header
        t, version, flags = int(h["step"]), int(h["version"]), int(h["flags"])
        if w in self.ended:
            raise ProtocolError(f"rank 0: REPORT iteration {t} from unit rank {w} after its last iteration")
        if t != self.last_step[w]:
            raise ProtocolError(f"rank 0: REPORT from unit rank {w} has iteration {t}, expected "
                                f"{self.last_step[w]} (duplicate or out-of-order report)")
        self.last_step[w] = t + 1
        applied = not flags & Flag.WARMUP
        k = self.module_of(w)
        if applied and k == self.K - 1 and w <= self.K:  # the last module of replica 0: one minibatch done
            self.version = int(h["epoch"]) + 1
            self.samples = self.version * self.cfg.batch_size * self.N
            self.log.add("updates", (self.now(), self.version, float(h["lr"]), float("nan"), self.samples,
                                     self.epoch))
            loss = float(h["loss"])
            self.loss_avg = loss if self.loss_avg != self.loss_avg else 0.95 * self.loss_avg + 0.05 * loss
            self.watch_loss(loss, int(h["correct"]), int(h["samples"]))
        nonfinite = bool(flags & Flag.NONFINITE)
        staleness = t - version if applied or nonfinite else 0
        if applied:
            self.count_staleness(staleness)
        self.log.add("pushes", (self.now(), w, t, version, t, staleness, h["loss"], h["correct"], h["samples"],
                                h["epoch"], h["compute_s"], h["comm_s"], h["wait_s"], applied, h["lr"], nonfinite,
                                0.0, h["digest"]))
        self.check_replicas(k, t, w, int(h["digest"]), self.N)
        if nonfinite:  # the module's replicas skipped this update together
            self.log.add("events", (self.now(), b"skip", f"iteration {t}: module {k} (unit rank {w}) got a "
                                                         f"non-finite gradient for minibatch {int(h['epoch'])}; "
                                                         f"update skipped"))
            self.reject(w, t)
        elif applied:
            self.rejects_in_row[w] = 0
        if flags & Flag.PREEMPT and not self.preempted and not self.late_signal:
            self.preempt(f"a signal received by unit rank {w} (module {k})" if k and not flags & Flag.END
                         else "a signal reached the pipeline (module 0 ends the run)")
        if flags & Flag.LAST and not self.stop_reason:
            self.stop_reason = f"the stopping rule after {int(h['step']) + 1} minibatches per replica"
            self.stop_time = self.now()
            self.log.add("events", (self.now(), b"stop", self.stop_reason))
        if flags & Flag.END:
            self.ended.add(w)
            if k == 0:
                self.send_stop(w)

    def on_snapshot(self, w: int, msg: Message) -> None:
        if w > self.K:
            raise ProtocolError(f"rank 0: SNAPSHOT from unit rank {w}; only replica 0 (ranks 1..{self.K}) sends them")
        k = self.module_of(w)
        start, stop = self.ranges[k]
        self.params[start:stop] = msg.payload
        if int(msg.header["flags"]) & Flag.FINAL:
            self.final.add(k)
            return
        key = (int(msg.header["cursor"]), int(msg.header["step"]))  # (segment, iteration in it)
        got = self.pieces.setdefault(key, set())
        got.add(k)
        if len(got) == self.K:  # every module's weights after the same iteration: a whole-model snapshot
            del self.pieces[key]
            self.snapshot()

    def finish(self) -> dict:
        """Evaluate the final weights on the whole test set (rank 0, numpy; not when preempted), then the
        usual summary."""
        if self.preempted:
            return super().finish()
        weights = self.params.copy()
        self.model.bind(weights, np.zeros_like(weights))
        idx = np.arange(self.dataset.test_y.size, dtype=np.int64)
        loss_sum, correct, count = evaluate(self.model, self.dataset, idx, self.cfg.eval_batch_size)
        self.evals = {1: (loss_sum, correct, count)}
        return super().finish()
