"""Turn-aware estimators (rlbench/algorithms/turns.py) on tiny hand-worked agentic batches."""

import math

import pytest
import torch
from floats import assert_close

from rlbench.algorithms import ADVANTAGE_DATA, advantage_fn, get, outcome_rewards

S3 = 1 / math.sqrt(3)  # the unbiased std of {1, 0, 1} or {1, 0, 0}: sqrt((2·(1/3)² + (2/3)²)/2) = sqrt(1/3)
E = 1e-6  # GRPO's ε


def episodes(layouts):
    """Loss mask and turn index from one string per episode: a digit = a sampled token of that turn,
    'o' = a tool-output token (a hole) of the turn before it, '.' = padding."""
    T = max(map(len, layouts))
    mask_B_T = torch.zeros(len(layouts), T)
    turn_B_T = torch.full((len(layouts), T), -1)
    for b, layout in enumerate(layouts):
        turn = -1
        for t, c in enumerate(layout):
            if c.isdigit():
                turn = int(c)
                mask_B_T[b, t] = 1
            if c != ".":
                turn_B_T[b, t] = turn
    return mask_B_T, turn_B_T


def expected(layouts, adv_by_turn):
    """Turn k's advantage on the sampled tokens of turn k, 0 on holes and padding."""
    mask_B_T, turn_B_T = episodes(layouts)
    rows = [[adv[k] if k >= 0 else 0.0 for k in turns] for adv, turns in zip(adv_by_turn, turn_B_T.tolist())]
    return torch.tensor(rows) * mask_B_T


# MT-GRPO: group 0 = episodes 0-2, group 1 = episode 3 alone.
MT_LAYOUTS = ["00oo11..", "0o111...", "000.....", "00......"]
MT_DATA = dict(
    group_ids=torch.tensor([0, 0, 0, 1]),
    turn_rewards_B_N=torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [2.0, 0.0]]),
    turns_B=torch.tensor([2, 2, 1, 1]),
)
MT_SCORES_B = torch.tensor([1.0, 0.0, 0.0, 3.0])


def test_mt_grpo_hand_worked():
    # outcome, group 0: s = [1, 0, 0], mean 1/3, std 1/√3 -> Â^O = [2/3, -1/3, -1/3]·√3 = [2/√3, -1/√3, -1/√3]
    # turn 0, group 0: R = [1, 0, 1], mean 2/3, std 1/√3 -> Â^T = [1/√3, -2/√3, 1/√3]
    # turn 1, group 0: episodes 0 and 1 only (episode 2 has one turn): R = [1, 0], mean 0.5, std √0.5 -> [√.5, -√.5]
    # λ = 0.5: A_0 = [2/√3 + 0.5/√3, 2/√3 + 0.5·√.5] ; A_1 = [-1/√3 - 1/√3, -1/√3 - 0.5·√.5] ; A_2 = [-1/√3 + 0.5/√3]
    # group 1 (one episode): Â^O = 3/(1 + ε) (GRPO's convention), turn 0 reached by it alone -> Â^T = 0
    mask_B_T, turn_B_T = episodes(MT_LAYOUTS)
    rewards_B_T = outcome_rewards(MT_SCORES_B, mask_B_T)
    adv_B_T, returns_B_T = advantage_fn("mt_grpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, turn_coef=0.5, **MT_DATA)
    h = math.sqrt(0.5)
    want_B_T = expected(MT_LAYOUTS, [
        [2.5 * S3, 2 * S3 + 0.5 * h], [-2 * S3, -S3 - 0.5 * h], [-0.5 * S3], [3.0],
    ])
    assert_close(adv_B_T, want_B_T, atol=1e-5)  # 1e-5: ε (1e-6) in the stds, left out by hand
    assert_close(returns_B_T, adv_B_T)
    assert adv_B_T[0, 2:4].eq(0).all() and adv_B_T[1, 1] == 0  # the tool-output holes


def test_mt_grpo_without_std_and_without_turn_coef():
    mask_B_T, turn_B_T = episodes(MT_LAYOUTS)
    rewards_B_T = outcome_rewards(MT_SCORES_B, mask_B_T)
    estimator = advantage_fn("mt_grpo")
    # norm_by_std=False: Â^O = s - mean = [2/3, -1/3, -1/3 | 3]; turn 0: [1/3, -2/3, 1/3 | 0]; turn 1: [0.5, -0.5]
    adv_B_T, _ = estimator(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, norm_by_std=False, **MT_DATA)
    want_B_T = expected(MT_LAYOUTS, [[1.0, 2 / 3 + 0.5], [-1.0, -1 / 3 - 0.5], [0.0], [3.0]])
    assert_close(adv_B_T, want_B_T)
    # turn_coef=0: every turn gets the GRPO advantage of its episode
    adv_B_T, _ = estimator(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, turn_coef=0.0, **MT_DATA)
    grpo_B_T, _ = advantage_fn("grpo")(rewards_B_T, mask_B_T, group_ids=MT_DATA["group_ids"])
    assert_close(adv_B_T, grpo_B_T)


# GiGPO: group 0 = episodes 0-2 from anchor state 7; group 1 = episode 3, whose state id 7 is another state.
GI_LAYOUTS = ["0o1.....", "00o11...", "0o1o2...", "0......."]
GI_DATA = dict(
    group_ids=torch.tensor([0, 0, 0, 1]),
    turn_rewards_B_N=torch.zeros(4, 3),
    turns_B=torch.tensor([2, 2, 3, 1]),
    turn_state_B_N=torch.tensor([[7, 11, -1], [7, 11, -1], [7, 12, 11], [7, -1, -1]]),
)
GI_SCORES_B = torch.tensor([1.0, 0.0, 1.0, 5.0])


def gigpo_inputs():
    mask_B_T, turn_B_T = episodes(GI_LAYOUTS)
    return outcome_rewards(GI_SCORES_B, mask_B_T), mask_B_T, turn_B_T


def test_gigpo_hand_worked_without_std():
    # turn rewards r (the outcome on the last turn): ep0 [0, 1], ep1 [0, 0], ep2 [0, 0, 1], ep3 [5]
    # γ = 0.5 returns G: ep0 [0.5, 1], ep1 [0, 0], ep2 [0.25, 0.5, 1], ep3 [5]
    # episode: R = [1, 0, 1], mean 2/3 -> A^E = [1/3, -2/3, 1/3]; ep3 alone -> A^E = 5 - 0
    # state 7 (group 0): G = [0.5, 0, 0.25], mean 0.25 -> [0.25, -0.25, 0]
    # state 11: ep0 turn 1, ep1 turn 1, ep2 turn 2: G = [1, 0, 1], mean 2/3 -> [1/3, -2/3, 1/3]
    # state 12: ep2 turn 1 alone -> 0 ; state 7 of group 1: ep3 alone -> 0
    rewards_B_T, mask_B_T, turn_B_T = gigpo_inputs()
    adv_B_T, _ = advantage_fn("gigpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, gamma=0.5, norm="none", **GI_DATA)
    want_B_T = expected(GI_LAYOUTS, [
        [1 / 3 + 0.25, 1 / 3 + 1 / 3], [-2 / 3 - 0.25, -2 / 3 - 2 / 3], [1 / 3, 1 / 3, 1 / 3 + 1 / 3], [5.0],
    ])
    assert_close(adv_B_T, want_B_T)


def test_gigpo_hand_worked_with_std_and_step_coef():
    # episode: R = [1, 0, 1]: std 1/√3 -> A^E = [1/√3, -2/√3, 1/√3]; ep3 alone: 5/(1 + ε)
    # state 7: G = [0.5, 0, 0.25], mean 0.25, std sqrt((0.25² + 0.25²)/2) = 0.25 -> [1, -1, 0]
    # state 11: G = [1, 0, 1] -> [1/√3, -2/√3, 1/√3] ; states alone -> 0 ; ω = 2
    rewards_B_T, mask_B_T, turn_B_T = gigpo_inputs()
    adv_B_T, _ = advantage_fn("gigpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, gamma=0.5, step_coef=2.0, **GI_DATA)
    want_B_T = expected(GI_LAYOUTS, [
        [S3 + 2, S3 + 2 * S3], [-2 * S3 - 2, -2 * S3 - 4 * S3], [S3, S3, S3 + 2 * S3], [5.0],
    ])
    assert_close(adv_B_T, want_B_T, atol=1e-5, rtol=1e-5)  # ε in the denominators


def test_gigpo_defaults_are_the_papers():
    rewards_B_T, mask_B_T, turn_B_T = gigpo_inputs()
    default_B_T, _ = advantage_fn("gigpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, **GI_DATA)
    paper_B_T, _ = advantage_fn("gigpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, step_coef=1.0, gamma=0.95,
                                         norm="std", **GI_DATA)
    assert_close(default_B_T, paper_B_T)
    with pytest.raises(ValueError, match="unknown norm 'mean'"):
        advantage_fn("gigpo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, norm="mean", **GI_DATA)


# turn_rloo: group 0 = episodes 0-2, group 1 = episode 3 alone.
LOO_LAYOUTS = ["0o1..", "0....", "0o1o2", "0o1.."]
LOO_DATA = dict(
    group_ids=torch.tensor([0, 0, 0, 1]),
    turn_rewards_B_N=torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.0, 0.0], [0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]),
    turns_B=torch.tensor([2, 1, 3, 2]),
)
LOO_SCORES_B = torch.tensor([1.0, 0.0, 0.0, 1.0])


def test_turn_rloo_hand_worked():
    # turn rewards r (outcome on the last turn): ep0 [0.5, 1], ep1 [0.2], ep2 [0, 0.5, 0], ep3 [1, 1]
    # returns-to-go G: ep0 [1.5, 1], ep1 [0.2], ep2 [0.5, 0.5, 0], ep3 [2, 1]
    # turn 0: ep0 1.5 - (0.2 + 0.5)/2 = 1.15 ; ep1 0.2 - (1.5 + 0.5)/2 = -0.8 ; ep2 0.5 - (1.5 + 0.2)/2 = -0.35
    # turn 1 (ep0, ep2 reached it): ep0 1 - 0.5 = 0.5 ; ep2 0.5 - 1 = -0.5
    # turn 2: only ep2 -> 0 ; group 1: ep3 alone -> 0 on every turn
    mask_B_T, turn_B_T = episodes(LOO_LAYOUTS)
    rewards_B_T = outcome_rewards(LOO_SCORES_B, mask_B_T)
    adv_B_T, returns_B_T = advantage_fn("turn_rloo")(rewards_B_T, mask_B_T, turn_B_T=turn_B_T, **LOO_DATA)
    assert_close(adv_B_T, expected(LOO_LAYOUTS, [[1.15, 0.5], [-0.8], [-0.35, -0.5, 0.0], [0.0, 0.0]]))
    assert_close(returns_B_T, expected(LOO_LAYOUTS, [[1.5, 1.0], [0.2], [0.5, 0.5, 0.0], [2.0, 1.0]]))


def test_turn_rloo_baseline_ignores_the_episode_itself():
    # raising episode 0's outcome by δ raises its own advantages by exactly δ (its baseline is unchanged) and
    # lowers the others' at the turns it reached by δ/(n - 1) = δ/2 at turn 0, δ/1 at turn 1
    mask_B_T, turn_B_T = episodes(LOO_LAYOUTS)
    estimator = advantage_fn("turn_rloo")
    before_B_T, _ = estimator(outcome_rewards(LOO_SCORES_B, mask_B_T), mask_B_T, turn_B_T=turn_B_T, **LOO_DATA)
    raised_B = LOO_SCORES_B + torch.tensor([0.4, 0.0, 0.0, 0.0])
    after_B_T, _ = estimator(outcome_rewards(raised_B, mask_B_T), mask_B_T, turn_B_T=turn_B_T, **LOO_DATA)
    assert_close(after_B_T - before_B_T,
                 expected(LOO_LAYOUTS, [[0.4, 0.4], [-0.2], [-0.2, -0.4, 0.0], [0.0, 0.0]]))


def test_token_rewards_count_in_their_own_turn():
    # a KL-in-reward penalty -0.1 on the first token of turn 0 and -0.2 on turn 1's, outcome 1 on the last token:
    # r = [-0.1, 0.8] -> G = [0.7, 0.8]: the turn-0 penalty is not in turn 1's return
    mask_B_T, turn_B_T = episodes(["0o1"])
    rewards_B_T = torch.tensor([[-0.1, 0.0, 0.8]])
    _, returns_B_T = advantage_fn("turn_rloo")(rewards_B_T, mask_B_T, group_ids=[0], turn_B_T=turn_B_T,
                                               turn_rewards_B_N=torch.zeros(1, 2), turns_B=torch.tensor([2]))
    assert_close(returns_B_T, torch.tensor([[0.7, 0.0, 0.8]]))


TURN_ESTIMATORS = ["gigpo", "mt_grpo", "turn_rloo"]


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_missing_turn_data_says_it_needs_an_agentic_task(name):
    alg = get("grpo").replace(name=f"{name}-test", advantage=name)
    mask_B_T, _ = episodes(LOO_LAYOUTS)
    rewards_B_T = outcome_rewards(LOO_SCORES_B, mask_B_T)
    with pytest.raises(ValueError, match=rf"^{name} needs turn_B_T, .*agentic"):
        alg.estimate(rewards_B_T, mask_B_T, group_ids=LOO_DATA["group_ids"])
    with pytest.raises(ValueError, match=rf"^{name} needs turn_B_T, turn_rewards_B_N, turns_B.*agentic"):
        alg.estimate(rewards_B_T, mask_B_T, group_ids=LOO_DATA["group_ids"], turn_B_T=None, turns_B=None)


def test_only_gigpo_needs_the_anchor_states():
    mask_B_T, turn_B_T = episodes(GI_LAYOUTS)
    data = {k: v for k, v in GI_DATA.items() if k != "turn_state_B_N"}
    with pytest.raises(ValueError, match=r"^gigpo needs turn_state_B_N: .*agentic"):
        advantage_fn("gigpo")(outcome_rewards(GI_SCORES_B, mask_B_T), mask_B_T, turn_B_T=turn_B_T, **data)


def test_estimate_passes_turn_data_only_to_estimators_that_declare_it():
    assert {"turn_B_T", "turn_rewards_B_N", "turns_B", "turn_state_B_N"} <= set(ADVANTAGE_DATA)
    mask_B_T, turn_B_T = episodes(GI_LAYOUTS)
    rewards_B_T = outcome_rewards(GI_SCORES_B, mask_B_T)
    data = dict(GI_DATA, turn_B_T=turn_B_T)
    gigpo_B_T, _ = get("grpo").replace(name="gigpo-test", advantage="gigpo").estimate(rewards_B_T, mask_B_T, **data)
    direct_B_T, _ = advantage_fn("gigpo")(rewards_B_T, mask_B_T, **data)
    assert_close(gigpo_B_T, direct_B_T)
    grpo_B_T, _ = get("grpo").estimate(rewards_B_T, mask_B_T, **data)  # grpo declares none of it
    assert_close(grpo_B_T, advantage_fn("grpo")(rewards_B_T, mask_B_T, group_ids=GI_DATA["group_ids"])[0])


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_a_sampled_token_outside_the_episodes_turns_is_an_error(name):
    mask_B_T, turn_B_T = episodes(GI_LAYOUTS)
    data = dict(GI_DATA, turns_B=torch.tensor([1, 2, 3, 1]))  # episode 0 samples in turn 1 but has 1 turn
    with pytest.raises(ValueError, match=r"turn index \(turn_B_T\) is outside \[0, turns_B\)"):
        get("grpo").replace(name=f"{name}-test", advantage=name).estimate(
            outcome_rewards(GI_SCORES_B, mask_B_T), mask_B_T, turn_B_T=turn_B_T, **data)
