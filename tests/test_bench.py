"""The pure logic of the benchmark scripts (bench/), on crafted numbers; the scripts themselves run MPI
jobs for minutes and are not part of the test suite.

bench/nsync.py: the trailing mean of the training loss over the latest pushes holding at least a
window of images, and the time at which it first reaches a target.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the scripts import their siblings

from nsync import time_to_loss, trailing_mean


def test_trailing_mean_waits_for_a_full_window_then_slides():
    loss = np.array([4.0, 3.0, 2.0, 1.0, 0.0])
    samples = np.array([10, 10, 10, 10, 10])
    curve = trailing_mean(loss, samples, window=20)
    assert np.isnan(curve[0])                            # 10 images < 20: undefined
    np.testing.assert_allclose(curve[1:], [3.5, 2.5, 1.5, 0.5])  # the latest two pushes each time


def test_trailing_mean_weights_by_images_and_takes_the_shortest_sufficient_window():
    loss = np.array([1.0, 2.0, 5.0])
    samples = np.array([30, 10, 30])
    curve = trailing_mean(loss, samples, window=35)
    # push 1: pushes 0..1 (40 >= 35); push 2: pushes 1..2 (40 >= 35), not 0..2
    np.testing.assert_allclose(curve, [np.nan, (30 * 1 + 10 * 2) / 40, (10 * 2 + 30 * 5) / 40])


def test_a_push_larger_than_the_window_is_its_own_mean():
    """nsync 100: one push holds more images than an epoch."""
    loss = np.array([0.9, 0.4, 0.2])
    samples = np.array([3200, 3200, 3200])
    np.testing.assert_allclose(trailing_mean(loss, samples, window=1437), loss)


def test_time_to_loss_is_the_first_push_at_or_below_the_target():
    times = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    loss = np.array([0.0, 2.0, 0.5, 0.3, 0.1])  # push 0 alone is below, but before a full window
    samples = np.full(5, 10)
    # trailing means over 20 images: nan, 1.0, 1.25, 0.4, 0.2
    assert time_to_loss(times, loss, samples, target=0.4, window=20) == pytest.approx(0.4)
    assert time_to_loss(times, loss, samples, target=0.2, window=20) == pytest.approx(0.5)
    assert time_to_loss(times, loss, samples, target=0.1, window=20) == math.inf


def test_time_to_loss_of_no_pushes_is_never():
    empty = np.array([])
    assert time_to_loss(empty, empty, np.array([], dtype=np.int64), target=1.0, window=10) == math.inf
