"""Bypass mode in a session (ALGORITHMS.md §9): no old-policy forward, the sampler's log-probs are old_logp."""

import pytest
import torch

import rlbench as rl

SMALL = dict(model="tiny-arith", task="arithmetic", cluster="inline", prompts_per_step=2, samples_per_prompt=4,
             max_new_tokens=8, threads=1, log_dir=None, seed=1, lr=1e-3)


def old_policy_forwards(session, monkeypatch) -> list:
    """The calls of the policy's log-prob forward (the old-policy forward of `advantage()`) from now on."""
    calls, forward = [], session.policy.log_probs_async
    monkeypatch.setattr(session.policy, "log_probs_async", lambda batch: calls.append(len(batch)) or forward(batch))
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
        assert first["correction/weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_without_bypass_the_old_policy_forward_runs(tiny_dir, monkeypatch):
    with rl.Session(**SMALL, algorithm="grpo") as s:
        calls = old_policy_forwards(s, monkeypatch)
        s.step()
        batch = s.last_batch
    assert calls == [len(batch)] and not torch.equal(batch["old_logp"], batch["sampler_logp"])
