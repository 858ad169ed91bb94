"""The parameter server's optimizer: SGD with momentum and weight decay, and the learning-rate schedule."""

from __future__ import annotations

import math

import numpy as np

from mpiasgd.config import Config


class SGD:
    """Heavy-ball SGD on one flat float32 parameter vector, updated in place.

        v <- momentum * v + (g + weight_decay * mask * w)
        w <- w - lr * v

    (the form of Sutskever et al. 2013 / PyTorch's `torch.optim.SGD`); `mask` is 1 on conv/linear
    weights and 0 on biases, so biases are not decayed. Arrays: float32 (P,), C-contiguous.
    """

    def __init__(self, params: np.ndarray, decay_mask: np.ndarray, momentum: float, weight_decay: float) -> None:
        self.params = params
        self.decay = (weight_decay * decay_mask).astype(np.float32)  # (P,), 0 on biases
        self.momentum = np.float32(momentum)
        self.velocity = np.zeros_like(params)
        self.scratch = np.empty_like(params)

    def step(self, grad: np.ndarray, lr: float) -> None:
        """Apply one update with step size `lr` for gradient `grad` (float32, (P,)); grad is not modified."""
        np.multiply(self.decay, self.params, out=self.scratch)
        self.scratch += grad
        self.velocity *= self.momentum
        self.velocity += self.scratch
        np.multiply(self.velocity, np.float32(lr), out=self.scratch)
        self.params -= self.scratch


def learning_rate(cfg: Config, epoch: float, progress: float) -> float:
    """Step size after `epoch` epochs of training, `progress` in [0, 1] the fraction of the run done.

    Linear warm-up from 0 to `cfg.lr` over `cfg.warmup_epochs` (Goyal et al. 2017), then
    constant, step (times `lr_gamma` at each epoch in `lr_milestones`) or cosine (Loshchilov and
    Hutter 2017: lr/2 * (1 + cos(pi * t)), t = `progress`, the fraction of the run done by the
    stopping rule closest to its limit).
    """
    if cfg.warmup_epochs > 0 and epoch < cfg.warmup_epochs:
        return cfg.lr * epoch / cfg.warmup_epochs
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.lr_gamma ** sum(epoch >= m for m in cfg.lr_milestones)
    if cfg.lr_schedule == "cosine":
        return 0.5 * cfg.lr * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return cfg.lr


def staleness_factor(rule: str, staleness: int) -> float:
    """Multiplier of the step size for a push of `staleness` (>= 0) under `rule`.

    "none": 1. "inverse": 1 / max(1, s), the staleness-dependent learning rate of Zhang, Gupta,
    Lian and Liu 2016 (arXiv 1511.05950, alpha / tau). "sqrt": 1 / sqrt(max(1, s)), a milder form.
    A fresh push (s = 0) and one of staleness 1 get the full step under every rule.
    """
    if rule == "inverse":
        return 1.0 / max(1, staleness)
    if rule == "sqrt":
        return 1.0 / math.sqrt(max(1, staleness))
    return 1.0
