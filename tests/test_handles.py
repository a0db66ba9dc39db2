"""The typed worker handles: a Tinker-style loop written with them gives the numbers of `Session.step()`.

Inline bit for bit; on Ray (two FSDP2 ranks, real gloo) within 1e-4 of the inline step.
"""

import pytest
import torch
from floats import approx, assert_close

import rlbench as rl

CONFIG = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=8, samples_per_prompt=4,
              max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)
COMPARED = ["loss", "pg_loss", "kl_loss", "entropy", "clip_frac", "grad_norm", "lr"]


def handle_step(s: rl.Session) -> dict:
    """One GRPO step as a notebook would write it by hand, through the handles (no `s.advantage` / `s.update`)."""
    batch = s.score(s.rollout())
    mask_B_T = batch["response_mask"].float()
    batch = batch.with_columns(old_logp=s.policy.log_probs(batch), ref_logp=s.reference.log_probs(batch))
    rewards_B_T = rl.algorithms.outcome_rewards(batch["reward"], mask_B_T)
    advantages_B_T, _ = rl.algorithms.get("grpo").estimate(rewards_B_T, mask_B_T, group_ids=batch["group_ids"])
    stats = s.policy.forward_backward(batch.with_columns(advantages=advantages_B_T))
    stats |= s.policy.optim_step()
    s.sync_weights()
    return stats


def test_a_handle_loop_is_session_step_bit_for_bit():
    """`step()` trains with `train_step`, the loop here with `forward_backward` then `optim_step`: the same numbers."""
    with rl.Session(**CONFIG, cluster="inline") as stepped:
        expected = [stepped.step() for _ in range(3)]
        expected_weights = stepped.policy.state_dict()
    with rl.Session(**CONFIG, cluster="inline") as s:
        assert isinstance(s.policy, rl.workers.PolicyHandle) and isinstance(s.sampler, rl.workers.SamplerHandle)
        rows = [handle_step(s) for _ in range(3)]
        weights = s.policy.state_dict()
    for row, want in zip(rows, expected):
        assert {k: row[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name


def test_forward_backward_takes_another_loss_and_accumulates():
    """`loss_fn=` a plain loss function (reduced the session's algorithm's way); gradients accumulate over
    calls until `optim_step()`, which consumes them."""
    def plain_pg(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T):
        return -advantages_B_T * rl.algorithms.ratio(logp_B_T, old_logp_B_T), {}

    with rl.Session(**CONFIG, cluster="inline") as s:
        batch = s.advantage(s.score(s.rollout()))
        first = s.policy.forward_backward(batch[:16], loss_fn=plain_pg)
        second = s.policy.forward_backward(batch[16:], loss_fn=plain_pg)
        assert set(first) >= {"loss", "pg_loss"} and first["loss"] != second["loss"]
        before = {k: v.clone() for k, v in s.policy.state_dict().items()}
        step = s.policy.optim_step()
        assert step["skipped"] == 0.0 and step["grad_norm"] > 0
        assert any(not torch.equal(v, before[k]) for k, v in s.policy.state_dict().items())
        assert s.policy.optim_step()["grad_norm"] == 0.0  # the step consumed the gradients


def test_sampler_handle_generates_from_examples_or_prompts():
    with rl.Session(**CONFIG, cluster="inline") as s:
        params = rl.samplers.SamplingParams(max_new_tokens=8, temperature=0)
        by_example = s.sampler.generate([{"prompt": "12+34="}], params)
        by_text = s.sampler.generate(["12+34="], params)
        assert by_example["completion"] == by_text["completion"] == s.complete(["12+34="])
        assert by_text["example"] == [{"prompt": "12+34="}] and s.scorer.score(
            by_text["completion"], [{"prompt": "12+34=", "answer": "46"}], by_text["finished"])[0].shape == (1,)


@pytest.mark.slow
def test_a_handle_loop_on_ray_matches_inline_within_1e_4():
    with rl.Session(**CONFIG, cluster="inline") as stepped:
        expected = [stepped.step() for _ in range(2)]
        expected_weights = stepped.policy.state_dict()
    with rl.Session(**CONFIG, cluster="ray", world_size=2) as s:
        rows = [handle_step(s) for _ in range(2)]
        weights = s.policy.state_dict()
    for row, want in zip(rows, expected):
        for key in COMPARED:
            assert row[key] == approx(want[key], abs=1e-4), key  # the test's claim: within 1e-4 of inline
    for name, value in expected_weights.items():
        assert_close(weights[name], value, atol=1e-4, msg=name)  # 2 ranks reduce in another order
