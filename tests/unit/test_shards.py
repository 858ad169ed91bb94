"""The cut of the parameter vector into parameter-server shards (`mpiasgd.comms.shard_cut`)."""

from __future__ import annotations

import pytest

from mpiasgd.comms.shard_cut import ALIGN, ShardCut, ShardError


@pytest.mark.parametrize("params,buffers,shards", [(4_000_000, 0, 2), (85_098, 0, 4), (1000, 600, 2),
                                                   (4_000_000, 1000, 3), (17, 0, 2), (100, 0, 7), (5, 3, 1)])
def test_cut_covers_the_vector_in_aligned_slices_of_balanced_bytes(params, buffers, shards):
    cut = ShardCut.balanced(params, buffers, shards)
    assert cut.shards == shards and cut.num_params == params
    assert cut.bounds[0] == 0 and cut.bounds[-1] == params
    assert all(cut.size(s) >= 1 for s in range(shards))
    assert all(b % ALIGN == 0 for b in cut.bounds[1:-1])
    counts = [cut.count(s) for s in range(shards)]
    assert sum(counts) == params + buffers
    if params >= 10 * shards * ALIGN and buffers < params // shards:  # room to balance: within one block
        assert max(counts) - min(counts) <= ALIGN


def test_cut_by_hand():
    # 1,000 parameters and 600 buffers on 2 shards: 800 values each; shard 0 holds 800 - 600 = 200 parameters,
    # rounded to the 16-value line: 192 (792 values) against 808
    cut = ShardCut.balanced(1000, 600, 2)
    assert cut.bounds == (0, 192, 1000)
    assert (cut.count(0), cut.count(1)) == (792, 808)
    assert cut.slice(1) == (192, 1000)
    assert cut.attrs() == {"servers": 2, "shard_bounds": [0, 192, 1000], "shard_params": [192, 808]}
    assert ShardCut.balanced(17, 0, 2).bounds == (0, 16, 17)  # the last shard keeps the short block


def test_buffers_larger_than_a_share_leave_shard_0_one_block():
    cut = ShardCut.balanced(1000, 5000, 2)
    assert cut.bounds == (0, 16, 1000)


def test_too_many_shards_is_one_clear_error():
    with pytest.raises(ShardError, match=r"--servers 4: the model.s 40 parameters make 3 blocks .* --servers <= 3"):
        ShardCut.balanced(40, 0, 4)
    with pytest.raises(ShardError, match="--servers must be >= 1"):
        ShardCut.balanced(40, 0, 0)
    with pytest.raises(ShardError, match="increase from 0"):
        ShardCut((0, 10, 10))
