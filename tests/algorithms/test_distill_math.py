"""On-policy distillation's parts (rlbench/algorithms/distill.py) on hand-worked tensors."""

import math

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import (Algorithm, advantage_fn, describe, forward_kl_topk, get, names, reverse_kl_advantages,
                                teacher_topk)

MASK_B_T = torch.tensor([[1.0, 1.0, 0.0]])
OLD_B_T = torch.tensor([[0.5, 0.25, 0.9]]).log()
TEACHER_B_T = torch.tensor([[0.25, 0.25, 0.1]]).log()


def test_reverse_kl_advantage_k1_and_k3():
    # k1 = logπ_s - logπ_t: [log 2, 0];   A = -k1, 0 on the masked token
    adv_B_T, returns_B_T = advantage_fn("reverse_kl")(torch.zeros(1, 3), MASK_B_T, old_logp_B_T=OLD_B_T,
                                                      teacher_logp_B_T=TEACHER_B_T)
    assert_close(adv_B_T, torch.tensor([[-math.log(2), 0.0, 0.0]]))
    assert_close(returns_B_T, adv_B_T)
    # k3 with κ = logπ_t - logπ_s = -log 2: e^κ - κ - 1 = 1/2 + log 2 - 1
    adv_B_T, _ = advantage_fn("reverse_kl")(torch.zeros(1, 3), MASK_B_T, old_logp_B_T=OLD_B_T,
                                            teacher_logp_B_T=TEACHER_B_T, estimator="k3")
    assert_close(adv_B_T, torch.tensor([[-(math.log(2) - 0.5), 0.0, 0.0]]))


def test_reverse_kl_ignores_the_reward_and_names_what_it_needs():
    rewards_B_T = torch.tensor([[0.0, 5.0, 0.0]])
    adv_B_T, _ = advantage_fn("reverse_kl")(rewards_B_T, MASK_B_T, old_logp_B_T=OLD_B_T, teacher_logp_B_T=TEACHER_B_T)
    assert adv_B_T[0, 1] == 0.0
    with pytest.raises(ValueError, match="teacher_logp_B_T .a session with teacher"):
        advantage_fn("reverse_kl")(rewards_B_T, MASK_B_T, old_logp_B_T=OLD_B_T)
    with pytest.raises(ValueError, match="unknown reverse-KL estimator 'k2'; valid: k1, k3"):
        reverse_kl_advantages(OLD_B_T, TEACHER_B_T, MASK_B_T, "k2")


def test_distill_coef_adds_the_reverse_kl_to_any_estimator():
    # GRPO over a group of two (scores 1, 0): A = ±1/√2 on every valid token; plus 0.5·(-k1)
    mask_B_T = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewards_B_T = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old_B_T = torch.tensor([[0.5, 0.5], [0.2, 0.3]]).log()
    teacher_B_T = torch.tensor([[0.25, 0.5], [0.4, 0.3]]).log()
    data = dict(group_ids=torch.tensor([0, 0]), old_logp_B_T=old_B_T, teacher_logp_B_T=teacher_B_T)
    plain, _ = get("grpo").estimate(rewards_B_T, mask_B_T, **data)
    mixed, _ = get("grpo").replace(distill_coef=0.5).estimate(rewards_B_T, mask_B_T, **data)
    a = 1 / math.sqrt(2)
    assert_close(plain, torch.tensor([[a, a], [-a, 0.0]]))
    assert_close(mixed, torch.tensor([[a - 0.5 * math.log(2), a], [-a + 0.5 * math.log(2), 0.0]]))
    with pytest.raises(ValueError, match="distill_coef > 0: it needs teacher_logp_B_T"):
        get("grpo_opd").estimate(rewards_B_T, mask_B_T, group_ids=data["group_ids"], old_logp_B_T=old_B_T)


def test_forward_kl_topk_hand_worked():
    # teacher top-2 p = [1/2, 1/4], student q there = [1/4, 1/4]: D = 1/2·log 2 + 1/4·0
    teacher = torch.tensor([[[0.5, 0.25]]]).log()
    student = torch.tensor([[[0.25, 0.25]]]).log()
    divergence, teacher_mass, student_mass = forward_kl_topk(student, teacher)
    assert_close(divergence, torch.tensor([[0.5 * math.log(2)]]))
    assert_close(teacher_mass, torch.tensor([[0.75]]))
    assert_close(student_mass, torch.tensor([[0.5]]))


def test_teacher_topk_is_normalised_over_the_whole_vocabulary_and_full_k_is_the_exact_kl():
    generator = torch.Generator().manual_seed(0)
    teacher_B_T_V, student_B_T_V = torch.randn(2, 2, 3, 6, generator=generator)
    logp_B_T_K, ids_B_T_K = teacher_topk(teacher_B_T_V, 2)
    full_B_T_V = teacher_B_T_V.log_softmax(-1)
    assert_close(logp_B_T_K, full_B_T_V.topk(2).values)
    assert_close(ids_B_T_K, full_B_T_V.topk(2).indices)
    # the candidates stop at `vocab`; the normalisation does not
    limited, ids = teacher_topk(teacher_B_T_V, 6, vocab=4)
    assert limited.shape[-1] == 4 and int(ids.max()) < 4
    assert_close(limited.exp().sum(-1), full_B_T_V[..., :4].exp().sum(-1))
    # k = V: the exact KL(p || q)
    logp_B_T_V, ids_B_T_V = teacher_topk(teacher_B_T_V, 100)
    student_logp = student_B_T_V.log_softmax(-1)
    divergence, mass, _ = forward_kl_topk(student_logp.gather(-1, ids_B_T_V), logp_B_T_V)
    exact = (full_B_T_V.exp() * (full_B_T_V - student_logp)).sum(-1)
    assert_close(divergence, exact)
    assert_close(mass, torch.ones(2, 3))


def test_forward_kl_term_in_the_actor_loss():
    # one token, advantage 0 (the policy-gradient term is 0): loss = 2·D, token-mean over one token
    logp_B_T = torch.zeros(1, 1)
    teacher = torch.tensor([[[0.5, 0.25]]]).log()
    student = torch.tensor([[[0.25, 0.25]]]).log()
    algorithm = get("grpo").replace(kl_coef=0.0, forward_kl_coef=2.0, reduction="token-mean")
    loss, metrics = algorithm.actor_loss(logp_B_T, logp_B_T, torch.zeros(1, 1), torch.ones(1, 1),
                                         topk_logp_B_T_K=student, teacher_topk_logp_B_T_K=teacher)
    assert_close(loss, torch.tensor(math.log(2)))
    assert metrics["forward_kl"] == approx(0.5 * math.log(2))
    assert metrics["teacher_topk_mass"] == approx(0.75) and metrics["student_topk_mass"] == approx(0.5)
    with pytest.raises(ValueError, match="forward_kl_coef > 0: pass topk_logp_B_T_K and teacher_topk_logp_B_T_K"):
        algorithm.actor_loss(logp_B_T, logp_B_T, torch.zeros(1, 1), torch.ones(1, 1))


def test_declarations_names_and_descriptions():
    assert {"opd", "grpo_opd"} <= set(names()) and "reverse_kl" in names("advantage")
    assert get("opd").needs_teacher and get("grpo_opd").needs_teacher and not get("grpo").needs_teacher
    assert get("grpo").replace(forward_kl_coef=0.1).needs_teacher
    assert not get("opd").needs_reference and not get("grpo_opd").needs_reference
    assert "GKD" in describe("opd") and "A_t = -k(logπ_old_t, logπ_teacher_t)" in describe("reverse_kl")
    assert "A_t += 1·(-k(logπ_old_t, logπ_teacher_t)), k = k1" in describe("grpo_opd")
    assert "top-64 distribution" in get("grpo").replace(forward_kl_coef=0.5).describe()


@pytest.mark.parametrize("fields, message", [
    (dict(distill_estimator="k2"), "unknown reverse-KL estimator .distill_estimator. 'k2'; valid: k1, k3"),
    (dict(distill_coef=-1.0), "distill_coef and forward_kl_coef must be >= 0 and teacher_topk >= 1"),
    (dict(teacher_topk=0), "teacher_topk >= 1"),
])
def test_bad_distillation_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        Algorithm(name="x", advantage="grpo", loss="ppo_clip", **fields)
