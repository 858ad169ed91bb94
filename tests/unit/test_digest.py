"""The REPORT digest by which rank 0 checks that replicas agree (`mpiasgd.comms.protocol.weights_digest`):
an integer sum of the bits, the same in any order and chunking, that tells changed or swapped values apart."""

from __future__ import annotations

import numpy as np
import pytest

from mpiasgd.comms import protocol
from mpiasgd.comms.protocol import weights_digest


def by_hand(values: np.ndarray) -> int:
    total = sum(int(b) * (2 * i + 1) for i, b in enumerate(values.view(np.uint32))) % 2**64
    return (total ^ (total >> 32)) & 0xFFFFFFFF


def test_the_digest_is_the_documented_sum():
    v = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert weights_digest(v) == by_hand(v) and 0 <= weights_digest(v) < 2**32


def test_chunks_and_vectors_continue_one_sum(monkeypatch):
    rng = np.random.default_rng(2)
    params, buffers = rng.standard_normal(777).astype(np.float32), rng.standard_normal(35).astype(np.float32)
    whole = by_hand(np.concatenate([params, buffers]))
    assert weights_digest(params, buffers) == whole
    monkeypatch.setattr(protocol, "DIGEST_CHUNK", 64)  # 13 passes over params, one over buffers
    assert weights_digest(params, buffers) == whole
    assert weights_digest(params, np.zeros(0, np.float32)) == by_hand(params)


def test_a_changed_or_swapped_value_changes_it():
    v = np.linspace(-1, 1, 4096, dtype=np.float32)
    base = weights_digest(v)
    changed = v.copy()
    changed[100] = np.nextafter(changed[100], np.float32(2))  # one bit of one value
    swapped = v.copy()
    swapped[[10, 3000]] = swapped[[3000, 10]]
    negzero = np.zeros(8, np.float32)
    negzero[5] = -0.0  # the same value, other bits: replicas must hold the same bits
    assert len({base, weights_digest(changed), weights_digest(swapped)}) == 3
    assert weights_digest(negzero) != weights_digest(np.zeros(8, np.float32))


@pytest.mark.parametrize("size", [0, 1, 5])
def test_small_vectors(size):
    v = np.arange(size, dtype=np.float32)
    assert weights_digest(v) == by_hand(v)
