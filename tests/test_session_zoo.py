"""The zoo's session plumbing (docs/algorithms.md, bypass): bypass mode runs no old-policy forward (the sampler's log-probs
are old_logp); OTB reads Σ_v π_v² from the old-policy forward."""

import pytest
import torch
from floats import approx, assert_close

import rlbench as rl

SMALL = dict(model="tiny-arith", task="arithmetic", cluster="inline", prompts_per_step=2, samples_per_prompt=4,
             max_new_tokens=8, threads=1, log_dir=None, seed=1, lr=1e-3)


def old_policy_forwards(session, monkeypatch) -> list:
    """The calls of the policy's log-prob forward (the old-policy forward of `advantage()`) from now on."""
    calls, forward = [], session.policy.log_probs_async
    monkeypatch.setattr(session.policy, "log_probs_async",
                        lambda batch, sum_pi2=False: calls.append((len(batch), sum_pi2)) or forward(batch, sum_pi2))
    return calls


@pytest.mark.parametrize("name", ["grpo_bypass", "grpo_bypass_pg"])
def test_bypass_runs_no_old_policy_forward(tiny_dir, monkeypatch, name):
    with rl.Session(**SMALL, algorithm=name) as s:
        calls = old_policy_forwards(s, monkeypatch)
        first = s.step()
        second = s.step()
        batch = s.last_batch
    assert calls == []
    assert torch.equal(batch["old_logp"], batch["sampler_logp"]) and "correction_weights" not in batch
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in (first, second))
    if name == "grpo_bypass_pg":  # the loss computed the weights: sampler and trainer agree up to kernels
        assert first["correction/weight_mean"] == approx(1.0, abs=1e-3)


def test_without_bypass_the_old_policy_forward_runs(tiny_dir, monkeypatch):
    with rl.Session(**SMALL, algorithm="grpo") as s:
        calls = old_policy_forwards(s, monkeypatch)
        s.step()
        batch = s.last_batch
    assert calls == [(len(batch), False)] and not torch.equal(batch["old_logp"], batch["sampler_logp"])


def test_otb_reads_sum_pi2_from_the_old_policy_forward(tiny_dir, monkeypatch):
    algorithm = rl.algorithms.get("grpo").replace(name="otb", advantage="otb", kl_coef=0.0)
    with rl.Session(**SMALL, algorithm=algorithm) as s:
        calls = old_policy_forwards(s, monkeypatch)
        s.step()
        batch = s.last_batch
    assert calls == [(len(batch), True)]  # one forward gives both
    mask = batch["response_mask"].bool()
    pi2_B_T, sum_pi2_B_T = batch["old_logp"].exp() ** 2, batch["sum_pi2"]
    assert (sum_pi2_B_T[mask] >= pi2_B_T[mask] - 1e-5).all() and (sum_pi2_B_T[mask] <= 1 + 1e-5).all()
    assert (sum_pi2_B_T[~mask] == 0).all()
    assert (batch["old_logp"] - batch["sampler_logp"])[mask].abs().max() < 1e-4  # the sampling policy's
    rewards_B_T = rl.algorithms.outcome_rewards(batch["reward"], batch["response_mask"].float())
    expected_B_T, _ = rl.algorithms.advantage_fn("otb")(
        rewards_B_T, batch["response_mask"].float(), group_ids=batch["group_ids"], old_logp_B_T=batch["old_logp"],
        sum_pi2_B_T=sum_pi2_B_T)
    assert_close(batch["advantages"], expected_B_T, atol=1e-5)  # 1e-5: torch's default this had (a slow test)


def test_otb_and_on_policy_old_logp_exclude_each_other(tiny_dir):
    algorithm = rl.algorithms.get("grpo").replace(name="otb", advantage="otb", kl_coef=0.0)
    with pytest.raises(ValueError, match="reads Σ_v π_v² per token"):
        rl.Session(**SMALL, algorithm=algorithm, on_policy_old_logp=True)
