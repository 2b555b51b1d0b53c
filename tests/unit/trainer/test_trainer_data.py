"""The resumable sampler: a resumed epoch is exactly the tail of the full one, and a deep seek lands on the right sample."""

from __future__ import annotations

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


def test_seeking_deep_into_a_huge_epoch_lands_on_the_right_sample():
    # A resume deep into a big epoch starts at the right global sample (no timed assertion: this ran under
    # CPU load in CI; the cost of a seek is one slice of the epoch's order).
    n, offset = 2_000_000, 1_600_001
    s = ResumableDistributedSampler(n, num_replicas=2, rank=1, seed=3)
    order = s.epoch_order()
    s.set_epoch(0, offset)  # rounded down to a whole step of both ranks
    it = iter(s)
    assert [next(it) for _ in range(3)] == [order[1_600_001], order[1_600_003], order[1_600_005]]
    assert len(s) == (n - 1_600_000) // 2


def test_batches_per_epoch():
    s = _sampler(30, 1, 0)
    assert batches_per_epoch(s, 4, drop_last=False) == 8
    assert batches_per_epoch(s, 4, drop_last=True) == 7


def _sampler(n, world, rank):
    return ResumableDistributedSampler(n, num_replicas=world, rank=rank, seed=5)


def test_a_set_too_small_for_one_dropped_last_batch_says_so(make_args):
    """Before, 3 rows with dataloader_drop_last and batches of 4 failed with 'the training data has no length (or
    is empty): set max_steps', naming neither the rows nor the setting that dropped them."""
    import torch

    from kubetrain_trainer import ConfigError, Trainer

    args = make_args(max_steps=-1, num_train_epochs=1, dataloader_drop_last=True, save_strategy="no")
    with pytest.raises(ConfigError, match=r"3 rows make no batch of per_device_train_batch_size 4 .* "
                                          r"set dataloader_drop_last: false"):
        Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=[{"x": torch.ones(1)}] * 3).train()
