"""learner.train.batching.plan_updates: mini-batches by rows, micro-batches by rows or a token budget."""

from __future__ import annotations

import pytest
import torch
from config_kit import nested

from learner.train.batching import plan_updates


def lens_of(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def rows(plan) -> list[list[list[list[int]]]]:
    return [[[m.tolist() for m in mb] for mb in epoch] for epoch in plan]


def test_without_a_budget_rows_keep_their_order_in_cuts_of_micro_batch():
    g = torch.Generator().manual_seed(0)
    assert rows(plan_updates(5, 1, 0, 2, g)) == [[[[0, 1], [2, 3], [4]]]]
    # seq_lens alone changes nothing: the budget is what packs
    assert rows(plan_updates(5, 1, 0, 2, g, lens_of(9, 1, 9, 1, 9))) == [[[[0, 1], [2, 3], [4]]]]


def test_a_budget_packs_rows_longest_first_within_it():
    lens = lens_of(5, 30, 6, 12, 30, 7, 2, 12)
    plan = plan_updates(8, 1, 0, 64, torch.Generator().manual_seed(0), lens, micro_tokens=60)
    # 30 + 30 (2 x 30 = 60) | 12 + 12 + 7 + 6 + 5 (5 x 12 = 60) | 2
    assert rows(plan) == [[[[1, 4], [3, 7, 5, 2, 0], [6]]]]


def test_a_row_longer_than_the_budget_goes_alone_and_micro_batch_still_caps_rows():
    lens = lens_of(100, 3, 3, 3, 3, 3)
    plan = plan_updates(6, 1, 0, 2, torch.Generator().manual_seed(0), lens, micro_tokens=50)
    assert rows(plan) == [[[[0], [1, 2], [3, 4], [5]]]]


@pytest.mark.parametrize("epochs,mini", [(1, 0), (3, 4), (2, 5)])
def test_every_mini_batch_keeps_its_rows_and_every_micro_batch_fits(epochs, mini):
    """The budget reorders and cuts inside each mini-batch only: the same mini-batches (so the
    same optimizer steps) as without it, every row once per epoch, every micro-batch within the
    budget or a single row, and at most micro_batch rows."""
    B, budget, micro = 16, 40, 6
    lens = torch.randint(2, 30, (B,), generator=torch.Generator().manual_seed(1))
    lens[3] = 55                                       # over the budget: alone
    plain = plan_updates(B, epochs, mini, micro, torch.Generator().manual_seed(7))
    packed = plan_updates(B, epochs, mini, micro, torch.Generator().manual_seed(7), lens, budget)
    assert len(packed) == epochs
    for ep_plain, ep_packed in zip(plain, packed, strict=True):
        assert len(ep_plain) == len(ep_packed)
        seen = []
        for mb_plain, mb_packed in zip(ep_plain, ep_packed, strict=True):
            assert sorted(torch.cat(mb_plain).tolist()) == sorted(torch.cat(mb_packed).tolist())
            for m in mb_packed:
                widest = int(lens[m].max())
                assert len(m) <= micro and (len(m) == 1 or len(m) * widest <= budget)
                assert lens[m].tolist() == sorted(lens[m].tolist(), reverse=True)
                seen += m.tolist()
        assert sorted(seen) == list(range(B))


def test_the_budget_is_a_learner_setting():
    from learner.config import LearnerConfig

    assert LearnerConfig().batch.micro_batch_tokens == 0
    assert LearnerConfig(**nested(micro_batch_tokens=4096)).batch.micro_batch_tokens == 4096
    with pytest.raises(ValueError):
        LearnerConfig(**nested(micro_batch_tokens=-1))
