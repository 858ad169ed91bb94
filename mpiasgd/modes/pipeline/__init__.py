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
              module gets back that minibatch's layer caches (`--pipeline-activations`: recompute
              re-runs its forward on the input it stored; store keeps the forward's activations, as
              FDG; see `unit`), back-propagates, sends the input gradient to module k-1, and updates
              its weights.

    decoupling "full" (FDG, Zhuang et al. 2021; the default):  forward of minibatch t - k at module
        k, which therefore updates with a gradient 2(K-1-k) iterations old (every message is
        consumed one iteration after it was sent: all K modules compute at the same time).
    decoupling "backward" (DDG, Huo et al. 2018):  the forward pass stays locked (minibatch t flows
        through every module within iteration t); only the backward is decoupled: delay K-1-k.

A module keeps exactly the inputs its delay needs (a queue of delay + 1 minibatches: their inputs,
or with `--pipeline-activations store` their layer caches; with `--weight-stashing` also the weights
each forward used, PipeDream's rule, which the backward then uses instead of the current weights; with
`--weight-prediction` the forward and the backward use the weights predicted for the update that applies
the gradient: w - lr c v, the module's delay d of momentum-only updates ahead, c = m (1 - m^d) / (1 - m)
(m the momentum; times m again with Nesterov), SpecTrain's rule, Chen et al. 2018, arXiv 1809.02839).
The first iterations of a module have no gradient yet (warm-up, logged with flag WARMUP). `--shrink
beta` multiplies the input gradient a module sends back, so module k's gradient is scaled by
beta^(K-1-k) (FDG's gradient shrinking). Replicas of a module average their gradients every
iteration (allreduce on the data communicator) and apply the same SGD step, so they stay identical
(every REPORT carries a digest of the module's weights and buffers, and rank 0 stops the run at the
first iteration where two replicas differ).

Layer buffers (BatchNorm's running statistics) belong to the module of their layer: a minibatch
updates them once, in its first forward (a recomputed forward leaves them alone), and the replicas
average them with the gradient (or alone, in the warm-up), so replicas hold the same ones (the
digest covers them); snapshots and checkpoints carry each module's slice, rank 0 assembles them. At the end every module
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

import math
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd.config import Config, ConfigError
from mpiasgd.modes.base import Layout, Mode, WorkerJob, need
from mpiasgd.modes.pipeline.monitor import PipelineMonitor
from mpiasgd.modes.pipeline.partition import Module, describe_partition, layer_costs, partition
from mpiasgd.modes.pipeline.unit import PipelineUnit

DECOUPLING = ("full", "backward")
ACTIVATIONS = ("recompute", "store")
BALANCE = ("flops", "params")

__all__ = ["MODE", "Module", "PipelineMode", "PipelineMonitor", "PipelineUnit", "cut_points", "describe_partition",
           "layer_costs", "partition"]


def cut_points(cfg: Config) -> tuple[int, ...]:
    """`cuts` parsed: increasing layer indices > 0 where modules 1..K-1 start; ConfigError if malformed."""
    try:
        cuts = tuple(int(c) for c in cfg.cuts.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"config key 'cuts' = {cfg.cuts!r}: expected comma-separated layer indices, "
                          f"e.g. '3,6'") from None
    if any(c <= 0 for c in cuts) or list(cuts) != sorted(set(cuts)):
        raise ConfigError(f"config key 'cuts' = {cfg.cuts!r}: expected increasing layer indices > 0")
    return cuts


class PipelineMode(Mode):
    name = "pipeline"

    def check_config(self, cfg: Config) -> None:
        need(cfg.modules >= 1, cfg, "modules", "an integer >= 1")
        need(cfg.replicas >= 0, cfg, "replicas", "an integer >= 0 (0: derived from the number of ranks)")
        need(cfg.balance in BALANCE, cfg, "balance", f"one of {BALANCE}")
        need(cfg.decoupling in DECOUPLING, cfg, "decoupling", f"one of {DECOUPLING}")
        need(math.isfinite(cfg.shrink) and 0 < cfg.shrink <= 1, cfg, "shrink", "0 < beta <= 1")
        need(cfg.pipeline_activations in ACTIVATIONS, cfg, "pipeline_activations", f"one of {ACTIVATIONS}")
        need(not cfg.weight_prediction or cfg.momentum > 0, cfg, "weight_prediction", "False with momentum 0 (the "
             "prediction follows the momentum)")
        cuts = cut_points(cfg)  # raises on a malformed list
        need(not cuts or len(cuts) == cfg.modules - 1, cfg, "cuts", f"{cfg.modules - 1} layer indices (--modules "
             f"{cfg.modules})")

    def layout(self, cfg: Config, model: Any, num_workers: int, num_train: int) -> Layout:
        """N replicas x K modules: unit (n, k) on rank 1 + n*K + k reads shard n and computes module k;
        ConfigError unless the workers are exactly N x K."""
        K = cfg.modules
        N = cfg.replicas or num_workers // K
        if N < 1 or N * K != num_workers:
            given = f" --replicas {cfg.replicas}" if cfg.replicas else ""
            raise ConfigError(f"--mode pipeline with --modules {K}{given} needs 1 + N x {K} ranks (rank 0 logs; "
                              f"N replicas of {K} modules), got {1 + num_workers} ranks; launch e.g. "
                              f"'mpiexec -n {1 + max(1, N) * K}'")
        bounds = partition(model, K, cut_points(cfg), cfg.balance)
        workers = range(1, num_workers + 1)
        return Layout(N, {w: (w - 1) // K for w in workers},
                      {w: (bounds[(w - 1) % K], bounds[(w - 1) % K + 1]) for w in workers},
                      {"module_bounds": bounds},  # module k: layers bounds[k]..bounds[k+1]-1
                      {w: ((w - 1) % K, (w - 1) // K) for w in workers})

    def communicators(self, cfg: Config, comm: Any, rank: int, layout: Layout) -> Any:
        """(the replica's pipeline communicator along k, the module's data communicator along n) for unit
        (n, k) on rank 1 + n*K + k; rank 0 gets MPI.COMM_NULL twice."""
        worker = rank > 0
        n, k = divmod(rank - 1, cfg.modules)
        return (comm.Split(n if worker else MPI.UNDEFINED, k), comm.Split(k if worker else MPI.UNDEFINED, n))

    def describe(self, cfg: Config, model: Any, layout: Layout, num_workers: int) -> str:
        cuts = describe_partition(model, layout.attrs["module_bounds"], cfg.balance, cfg.decoupling)
        replicas = num_workers // cfg.modules
        return (f"pipeline: {replicas} replica{'s' * (replicas != 1)} x {cfg.modules} modules, decoupling "
                f"{cfg.decoupling}, activations {cfg.pipeline_activations}:\n{cuts}")

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Layout) -> PipelineMonitor:
        return PipelineMonitor(r0, params, model, dataset, layout.attrs["module_bounds"])

    def worker(self, job: WorkerJob) -> PipelineUnit:
        return PipelineUnit(job)


MODE = PipelineMode()
