"""DAPO's group filter and overlong shaping (docs/algorithms.md)."""

import pytest
import torch
from floats import assert_close

from rlbench.algorithms import filter_groups, overlong_penalty


def test_filter_groups_drops_groups_without_signal():
    # group 4: [1, 1] all equal -> drop ; group 7: [0, 1] -> keep ; group 9: one sample -> keep (as verl) ;
    # group 3: [2, 2, 2] -> drop
    scores_B = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0])
    group_ids_B = torch.tensor([4, 4, 7, 7, 9, 3, 3, 3])
    keep_B = filter_groups(scores_B, group_ids_B)
    assert keep_B.tolist() == [False, False, True, True, True, False, False, False]


def test_overlong_penalty():
    # L_max 20, L_buf 5 -> penalty starts after 15 tokens: min(-(len - 15)/5·factor, 0)
    # lengths 10, 15, 17, 20 -> [0, 0, -0.4, -1]
    lengths_B = torch.tensor([10, 15, 17, 20])
    assert_close(overlong_penalty(lengths_B, 20, 5, 1.0), torch.tensor([0.0, 0.0, -0.4, -1.0]))
    assert_close(overlong_penalty(lengths_B, 20, 5, 0.5), torch.tensor([0.0, 0.0, -0.2, -0.5]))
    # a buffer below 1 is a fraction of L_max: 0.25·20 = 5 tokens
    assert_close(overlong_penalty(lengths_B, 20, 0.25), torch.tensor([0.0, 0.0, -0.4, -1.0]))


@pytest.mark.parametrize("buffer_len", [0, 21])
def test_overlong_penalty_rejects_bad_buffer(buffer_len):
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([10]), 20, buffer_len)
