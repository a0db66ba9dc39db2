"""Bookkeeping that cannot lie (issue 24's reproductions): run folders, restore overrides, dropout, and clear
errors for empty inputs, closed sessions and checkpoints of another algorithm."""

import pytest
import torch
from floats import approx
from transformers import GPT2Config, GPT2LMHeadModel

import rlbench as rl
from rlbench.policy import Policy

SMALL = dict(model="tiny-arith", task="arithmetic", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
             cluster="inline", seed=0)


def policy_rank(s: rl.Session) -> Policy:
    """The inline policy object (white-box: its optimizer's settings)."""
    return s.policy.workers.hosts[0].objects["policy"]


def test_two_sessions_in_the_same_second_get_their_own_run_folders(tmp_path):
    with rl.Session(**SMALL, lr=1e-4, log_dir=str(tmp_path)) as a, rl.Session(**SMALL, lr=3e-4, log_dir=str(tmp_path)) as b:
        assert a.run_name != b.run_name
        a.step(), b.step(), a.step()
    assert [len(p.read_text().splitlines()) for p in sorted(tmp_path.glob("*/metrics.jsonl"))] in ([2, 1], [1, 2])


def test_a_run_folder_held_by_a_live_session_is_refused(tmp_path):
    with rl.Session(**SMALL, log_dir=str(tmp_path), run_name="mine") as first:
        with pytest.raises(RuntimeError, match=r"mine.*held"):  # nothing logged yet: the name is taken by the lock
            rl.Session(**SMALL, log_dir=str(tmp_path), run_name="mine")
        first.step()
        path = first.save()
        with pytest.warns(UserWarning, match=r"holds an earlier run: this session is run 'mine-2'"):
            with rl.Session(**SMALL, log_dir=str(tmp_path), run_name="mine") as second:  # a run of its own
                assert second.run_name == "mine-2"
        with pytest.raises(RuntimeError, match=r"mine.*held"):
            rl.Session.restore(path)
    with rl.Session.restore(path) as restored:  # closed: the folder is free again
        assert restored.step_count == 1


def test_restore_overrides_reach_the_optimizer_and_the_metrics(tmp_path):
    with rl.Session(**SMALL, log_dir=None, lr=1e-4, weight_decay=0.0) as s:
        s.step()
        path = s.save(tmp_path)
    with rl.Session.restore(path, lr=1e-3, weight_decay=0.01, betas=(0.8, 0.99)) as s:
        group = policy_rank(s).optimizer.adamw.param_groups[0]
        assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-3, 0.01, (0.8, 0.99))
        assert s.step()["lr"] == 1e-3
    with rl.Session.restore(path, lr_schedule="linear", lr_decay_steps=2) as s:  # one step taken: halfway down
        assert s.step()["lr"] == approx(0.5e-4)


def test_restoring_without_a_critic_into_ppo_names_the_critic(tmp_path):
    with rl.Session(**SMALL, log_dir=None) as s:
        s.step()
        path = s.save(tmp_path)
    with pytest.raises(ValueError, match="trains a critic, and the checkpoint .* has none"):
        rl.Session.restore(path, algorithm="ppo")


def test_empty_inputs_and_a_closed_session_say_what_is_wrong():
    s = rl.Session(**SMALL, log_dir=None)
    assert s.complete([]) == []
    with pytest.raises(ValueError, match="no held-out prompts"):
        s.evaluate(max_prompts=0)
    with pytest.raises(ValueError, match=r"no held-out prompts \(task 'arithmetic': 0 examples given"):
        s.evaluate(examples=[])
    # other examples than the test split, scored by the task's reward: the first five test rows are the same five
    assert s.evaluate(examples=s.task.test[:5]) == s.evaluate(max_prompts=5)
    with pytest.raises(ValueError, match="no examples or prompts"):
        s.sampler.generate([], rl.samplers.SamplingParams())
    batch = s.advantage(s.score(s.rollout()))
    with pytest.raises(ValueError, match="the batch has 0 rows, fewer than world_size=1"):
        s.update(batch[[]])
    s.close()
    with pytest.raises(RuntimeError, match="'sampler' workers are closed"):
        s.rollout()


def test_dropout_is_off_in_the_trainer(tmp_path):
    """GPT-2's config has dropout 0.1: the trainer's log-probs are the sampler's (on-policy ratio 1) and
    repeat exactly."""
    config = GPT2Config(vocab_size=259, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1,
                        pad_token_id=0)
    assert config.resid_pdrop == 0.1
    with rl.models.quiet_transformers():
        GPT2LMHeadModel(config).save_pretrained(tmp_path)
    rl.models.build_tokenizer().save_pretrained(tmp_path)
    with rl.Session(**SMALL | dict(model=str(tmp_path)), log_dir=None, algorithm="dr_grpo") as s:
        scored = s.score(s.rollout())
        first, second = s.advantage(scored), s.advantage(scored)
        assert torch.equal(first["old_logp"], second["old_logp"])
        mask_B_T = first["response_mask"].bool()
        assert (first["old_logp"] - first["sampler_logp"])[mask_B_T].abs().max() < 1e-4
        assert s.update(first)["clip_frac"] == 0.0


def test_one_sample_per_prompt_is_refused_for_a_group_estimator():
    with pytest.raises(ValueError, match="samples_per_prompt=1: algorithm 'grpo' compares the samples of a prompt"):
        rl.Session(**SMALL | dict(samples_per_prompt=1), log_dir=None)
    with rl.Session(**SMALL | dict(samples_per_prompt=1), log_dir=None, algorithm="reinforce_pp") as s:  # no groups
        assert s.step()["reward_mean"] >= 0


def test_greedy_sampling_is_refused_for_a_group_estimator_whose_advantages_it_makes_all_zero():
    # the attack: temperature=0 made every group's samples the same completion and trained nothing, step after step
    with pytest.raises(ValueError, match=r"temperature=0: the 4 samples of a prompt are the same greedy completion, so "
                                         r"algorithm 'grpo', which compares them .* trains nothing"):
        rl.Session(**SMALL | dict(temperature=0.0), log_dir=None)
    # the same class of fault: top_k=1 samples the most likely token at any temperature
    with pytest.raises(ValueError, match=r"top_k=1: the 4 samples of a prompt are the same greedy completion"):
        rl.Session(**SMALL | dict(top_k=1), log_dir=None)
    with rl.Session(**SMALL | dict(top_k=1, samples_per_prompt=1), log_dir=None, algorithm="reinforce_pp") as s:
        assert s.step()["reward_mean"] >= 0  # no groups to compare: greedy samples still train


def test_a_stage_refuses_another_sessions_batch_naming_both():
    with rl.Session(**SMALL, log_dir=None) as arithmetic, rl.Session(**SMALL | dict(task="reverse"), log_dir=None) as reverse:
        batch = arithmetic.rollout()
        assert batch.meta["session"]["task"].startswith("arithmetic (")
        for stage in (reverse.score, reverse.advantage, reverse.update):
            with pytest.raises(ValueError, match=r"this batch comes from another session \(.*arithmetic.*\), not this one "
                                                 r"\(.*reverse"):
                stage(batch)
        arithmetic.update(arithmetic.advantage(arithmetic.score(batch)))  # its own session takes it


def test_dynamic_sampling_that_keeps_few_groups_takes_fewer_mini_batches():
    """DAPO with mini_batches_per_step=8 and one kept group of 4 rows: 4 optimizer steps of one row, no crash."""
    algorithm = rl.algorithms.get("dapo").replace(max_filter_rounds=0)
    with rl.Session(**SMALL, log_dir=None, algorithm=algorithm, mini_batches_per_step=8) as s:
        batch = s.advantage(s.score(s.rollout()))
        one_group = batch[batch["group_ids"] == batch["group_ids"][0]]
        stats = s.update(one_group)
        assert len(one_group) == 4 and stats["skipped"] == 0
        assert policy_rank(s).optimizer.scheduler.last_epoch == 4  # four optimizer steps of one row
    with pytest.raises(ValueError, match="dynamic sampling may keep a single group of samples_per_prompt=2 rows, fewer "
                                         "than world_size=4"):
        rl.Session(**SMALL | dict(samples_per_prompt=2, cluster="ray"), world_size=4, algorithm="dapo", log_dir=None)


def test_restore_skips_a_damaged_newest_checkpoint_saying_why(tmp_path):
    with rl.Session(**SMALL, log_dir=None) as s:
        s.step()
        older = s.save(tmp_path)
        s.step()
        newest = s.save(tmp_path)
    shard = next((newest / "policy").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.warns(UserWarning, match=r"step-000002.*distcp is truncated"):
        with rl.Session.restore(tmp_path) as restored:
            assert restored.step_count == 1 and older.name == "step-000001"
