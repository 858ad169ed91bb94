"""A pipeline of two modules on one replica (N = 1, K = 2, fully decoupled) computed by hand."""

from __future__ import annotations

import numpy as np

from kit.runs import B
from mpiasgd.data import ShardSampler, minibatches
from mpiasgd.model import build_model
from mpiasgd.modes.pipeline import Module
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import fraction_done, learning_rate, lookahead_factor


def reference_two_modules(digits, cfg, steps, stash=False, shrink=1.0, predict=False):
    """Module 0 (layers 0-3: conv1 relu1 pool1 conv2) forwards minibatch t at iteration t and back-propagates
    minibatch t-2 with the input gradient module 1 computed at iteration t-1; module 1 forwards, takes the
    loss and back-propagates minibatch t-1 at iteration t. Each updates after its backward (SGD with
    momentum, the run's schedule). `predict` (--weight-prediction): module 0 (delay 2) forwards minibatch t
    on w - lr(t) * c * v, c = m + m^2, and back-propagates it on the same weights."""
    model = build_model("digits")
    w0 = model.init_params(cfg.seed)
    mods = [Module(model, 0, 4), Module(model, 4, 8)]
    mask = cfg.weight_decay * model.decay_mask()
    velocity, decay = [], []
    for m in mods:
        m.params[...] = w0[m.start:m.stop]
        velocity.append(np.zeros(m.size, np.float32))
        decay.append(mask[m.start:m.stop].astype(np.float32))
    sampler = ShardSampler(digits.train_y.size, 1, 0, cfg.seed)
    batches, labels = minibatches(sampler, B), minibatches(sampler, B)
    rng = np.random.default_rng([cfg.seed, 1, 1])

    def lr_of(minibatch):
        done = minibatch * B / digits.train_y.size
        return learning_rate(cfg, done, fraction_done(cfg, done, minibatch, 0.0))

    def update(k, minibatch):
        numpy_ops.sgd_momentum(mods[k].params, velocity[k], mods[k].grads, decay[k], cfg.momentum, lr_of(minibatch))

    stored, act, delta = {}, None, None
    for t in range(steps + 2):  # two more iterations drain the pipeline
        new_act = new_delta = None
        if t < steps:
            x, _ = digits.batch("train", next(batches)[1], rng)
            c = cfg.momentum + cfg.momentum ** 2  # lookahead_factor(m, 2), written out
            assert abs(c - lookahead_factor(cfg.momentum, 2)) < 1e-12
            ahead = mods[0].params - np.float32(lr_of(t) * c) * velocity[0] if predict else None
            stored[t] = (x, ahead if predict else mods[0].params.copy() if stash else None)
            if predict:
                mods[0].bind(ahead)
            new_act = (t, mods[0].forward(x).copy())
            mods[0].bind(mods[0].params)
        if 0 <= t - 1 < steps:
            m, h = act
            y = digits.train_y[next(labels)[1]]
            _, _, dx = mods[1].loss_backward(mods[1].forward(h), y)
            new_delta = (m, dx * np.float32(shrink))
            update(1, m)
        if 0 <= t - 2 < steps:
            m, d = delta
            x, weights = stored.pop(m)
            if weights is not None:
                mods[0].bind(weights)
            mods[0].forward(x)
            mods[0].backward(d)
            mods[0].bind(mods[0].params)
            update(0, m)
        act, delta = new_act, new_delta
    return np.concatenate([mods[0].params, mods[1].params])
