"""The resumable sampler: a resumed epoch is exactly the tail of the full one, and seeking costs nothing."""

from __future__ import annotations

import time

import pytest

from kubetrain_trainer.data import ResumableDistributedSampler, batches_per_epoch


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offset_is_the_tail_of_the_full_epoch(world):
    full = [list(iter(_sampler(23, world, r))) for r in range(world)]
    for consumed in range(0, 24, world):
        for r in range(world):
            s = _sampler(23, world, r)
            s.set_epoch(0, consumed)
            assert list(s) == full[r][consumed // world:]
            assert len(s) == len(full[r]) - consumed // world


def test_ranks_partition_the_padded_epoch_and_epochs_differ():
    ranks = [list(_sampler(10, 3, r)) for r in range(3)]
    assert all(len(x) == 4 for x in ranks)  # padded to 12
    assert set(sum(ranks, [])) == set(range(10))
    s = _sampler(10, 1, 0)
    s.set_epoch(1)
    assert list(s) != list(_sampler(10, 1, 0)) and sorted(s) == list(range(10))


def test_world_size_change_keeps_the_global_order():
    one = list(_sampler(20, 1, 0))
    a, b = _sampler(20, 2, 0), _sampler(20, 2, 1)
    a.set_epoch(0, 8)
    b.set_epoch(0, 8)
    merged = [x for pair in zip(a, b) for x in pair]
    assert merged == one[8:]


def test_seeking_deep_into_a_huge_epoch_costs_the_same_as_seeking_near_its_start():
    n = 2_000_000
    def first_index_time(offset):
        s = ResumableDistributedSampler(n, num_replicas=2, rank=1, seed=3)
        start = time.perf_counter()
        s.set_epoch(0, offset)
        next(iter(s))
        return time.perf_counter() - start
    near, deep = first_index_time(20), first_index_time(1_600_000)
    assert deep < near * 1.5 + 0.05


def test_batches_per_epoch():
    s = _sampler(30, 1, 0)
    assert batches_per_epoch(s, 4, drop_last=False) == 8
    assert batches_per_epoch(s, 4, drop_last=True) == 7


def _sampler(n, world, rank):
    return ResumableDistributedSampler(n, num_replicas=world, rank=rank, seed=5)
