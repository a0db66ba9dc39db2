import pytest
import torch
from floats import approx, assert_close

import rlbench as rl
from rlbench.policy import Policy, Reference, micro_batches
from rlbench.policy.training import OptimSettings, lr_lambda


def gradients(policy):
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode, forward_kl", [(mode, False) for mode in rl.algorithms.REDUCTIONS]
                         + [("seq-mean-token-mean", True)])
def test_gradient_does_not_depend_on_micro_batching(tiny_dir, rollout, mode, forward_kl):
    policy = Policy(tiny_dir, OptimSettings(lr=1e-3), micro_batch_tokens=10_000)
    # off-policy on purpose (old_logp shifted) so clipping and the KL term are active
    batch = rollout.with_columns(old_logp=policy.log_probs(rollout) - 0.1 * rollout["response_mask"],
                                 ref_logp=policy.log_probs(rollout) + 0.05 * rollout["response_mask"])
    algorithm = rl.algorithms.get("grpo").replace(reduction=mode, kl_coef=0.1, entropy_coef=0.01)
    if forward_kl:  # distillation's forward KL to a teacher's top-4 (the model itself at temperature 2)
        teacher_B_T_X = Reference(tiny_dir, temperature=2.0).log_probs(rollout, topk=4)
        batch = batch.with_columns(teacher_topk_logp=teacher_B_T_X[..., 1:5],
                                   teacher_topk_ids=teacher_B_T_X[..., 5:].long())
        algorithm = algorithm.replace(forward_kl_coef=0.5, teacher_topk=4)
    counts = dict(num_tokens=int(batch["response_mask"].sum()), num_seqs=len(batch), norm_length=8)
    whole = policy.forward_backward(batch, algorithm, **counts)
    expected = gradients(policy)
    policy.optimizer.zero_grad()
    policy.micro_batch_tokens = 30  # a few rows per micro-batch
    assert len(micro_batches(batch, 30)) >= 4
    split = policy.forward_backward(batch, algorithm, **counts)
    # token-sum is not normalised: its gradient is num_tokens times larger, and so is its float noise; a large entry
    # (seq-mean-token-sum's sum over a sequence) is also allowed float32's relative noise (1.2e-6 off 1.58 seen)
    scale = counts["num_tokens"] if mode == "token-sum" else 1
    for name, grad in gradients(policy).items():
        assert_close(grad / scale, expected[name] / scale, msg=name)
    assert split["loss"] == approx(whole["loss"])  # token-sum: a sum of ~100 terms


def test_update_improves_the_surrogate_objective(tiny_dir, rollout):
    # a small step moves every sequence's mean log-prob in the direction of its advantage, on the whole:
    # the objective seq-mean-token-mean of A * logp rises (first order: Adam's step has a positive inner
    # product with the gradient)
    policy = Policy(tiny_dir, OptimSettings(lr=1e-5))
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    batch = rollout.with_columns(old_logp=policy.log_probs(rollout))
    mask = batch["response_mask"].float()
    adv_B = batch["advantages"][:, 0]

    def objective():
        return float((adv_B * (policy.log_probs(batch) * mask).sum(-1) / mask.sum(-1)).mean())

    before = objective()
    policy.forward_backward(batch, algorithm, num_tokens=int(mask.sum()), num_seqs=len(batch), norm_length=8)
    stats = policy.optim_step()
    assert objective() > before
    assert stats["grad_norm"] > 0 and stats["skipped"] == 0.0 and stats["lr"] == 1e-5


def test_non_finite_gradient_skips_the_step(tiny_dir, rollout):
    policy = Policy(tiny_dir, OptimSettings(lr=1e-3))
    batch = rollout.with_columns(old_logp=policy.log_probs(rollout),
                                 advantages=rollout["advantages"] * float("nan"))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    policy.forward_backward(batch, rl.algorithms.get("grpo").replace(kl_coef=0.0),
                            num_tokens=int(batch["response_mask"].sum()), num_seqs=len(batch), norm_length=8)
    stats = policy.optim_step()
    assert stats["skipped"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_lr_schedules():
    warm = lr_lambda("constant", 4, 100)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = lr_lambda("linear", 0, 10)
    assert linear(0) == 1.0 and linear(5) == 0.5 and linear(10) == 0.0 and linear(20) == 0.0
    cosine = lr_lambda("cosine", 0, 10)
    assert cosine(0) == 1.0 and cosine(5) == approx(0.5) and cosine(10) == approx(0.0)
