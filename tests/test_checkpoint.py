"""Checkpoints, inline: a resumed run is the uninterrupted run bit for bit; saves are atomic (a process
killed mid-save leaves the last good checkpoint); export gives a plain Hugging Face model folder; a
non-finite loss or gradient skips the step instead of corrupting the weights."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import rlbench as rl
from rlbench.runs import checkpoints
from rlbench.samplers import HFSampler

SMALL = dict(model="tiny-arith", task="arithmetic", cluster="inline", prompts_per_step=4, samples_per_prompt=4,
             max_new_tokens=8, threads=1, seed=5)


def _numbers(metrics):
    """The metrics that must repeat exactly (every column but wall-clock timings)."""
    return metrics.drop(columns=[c for c in metrics.columns if c.startswith("time_")])


# grpo: a reference model; ppo: a critic and adaptive KL; overlap: the batch sampled for the next step
@pytest.mark.parametrize("algorithm, overlap", [("grpo", False), ("ppo", False), ("grpo", True)],
                         ids=["grpo", "ppo", "grpo-overlap"])
def test_resume_is_the_uninterrupted_run_bit_for_bit(algorithm, overlap, tmp_path):
    with rl.Session(**SMALL, algorithm=algorithm, overlap_rollout=overlap, run_name="whole") as whole:
        expected = whole.run(5, progress=False)
        expected_weights = whole.policy.state_dict()

    with rl.Session(**SMALL, algorithm=algorithm, overlap_rollout=overlap, run_name="halves") as first:
        first.run(2, progress=False)
        folder = first.save(tmp_path / "ckpt")
    assert folder == tmp_path / "ckpt" / "step-000002"
    assert (folder / "next_batch.pt").is_file() == overlap
    with rl.Session.restore(tmp_path / "ckpt") as second:
        assert (second.step_count, second.run_name, second.config.algorithm) == (2, "halves", algorithm)
        metrics = second.run(3, progress=False)
        weights = second.policy.state_dict()
        logged = rl.runs.sinks.read_jsonl("runs/halves/metrics.jsonl")

    assert _numbers(metrics).equals(_numbers(expected))
    assert logged["step"].tolist() == [0, 1, 2, 3, 4]  # the log file goes on from the checkpoint
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name


def test_a_lagging_sampler_is_restored_as_it_was(tmp_path):
    with rl.Session(**SMALL, algorithm="grpo") as s:
        s.step()
        s.update(s.advantage(s.score(s.rollout())), sync=False)  # the sampler keeps the older weights
        folder = s.save(tmp_path)
        expected = s.rollout()
    assert (folder / "sampler.pt").is_file()
    with rl.Session.restore(folder) as r:
        assert torch.equal(r.rollout()["sampler_logp"], expected["sampler_logp"])


class WithoutStateDict:
    """A sampler that cannot hand its weights over (like the vLLM one)."""

    def __init__(self, model_dir):
        self._inner = HFSampler.from_pretrained(model_dir)

    def generate(self, prompt_ids, params):
        return self._inner.generate(prompt_ids, params)

    def load_weights(self, state_dict):
        self._inner.load_weights(state_dict)


def test_a_lagging_sampler_without_state_dict_is_named(tiny_dir, tmp_path):
    with rl.Session(**SMALL, sampler=WithoutStateDict(tiny_dir)) as s:
        s.update(s.advantage(s.score(s.rollout())), sync=False)
        with pytest.raises(ValueError, match=r"sampler's weights lag .*WithoutStateDict.*call sync_weights\(\)"):
            s.save(tmp_path)
        assert checkpoints.step_dirs(tmp_path) == []  # nothing half-written
        s.sync_weights()
        assert s.save(tmp_path).is_dir()


def test_periodic_saves_keep_the_last_k_and_restore_takes_the_latest(tmp_path):
    with rl.Session(**SMALL, save_every=2, keep_last=2, save_dir=str(tmp_path)) as s:
        s.run(7, progress=False)
    assert [p.name for p in checkpoints.step_dirs(tmp_path)] == ["step-000004", "step-000006"]
    with rl.Session.restore(tmp_path) as r:
        assert r.step_count == 6 and len(r.metrics) == 6


def test_restore_asks_again_for_python_objects(tmp_path):
    task = rl.tasks.get("arithmetic")
    with rl.Session(**(SMALL | dict(task=task))) as s:
        folder = s.save(tmp_path)
    with pytest.raises(ValueError, match=r"pass them again.*: task \(was Arithmetic\("):
        rl.Session.restore(folder)
    with rl.Session.restore(folder, task=task) as r:
        assert r.task.train[0] == task.train[0]


def test_restore_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=f"no checkpoint at {tmp_path / 'nothing'}: it does not exist"):
        rl.Session.restore(tmp_path / "nothing")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        rl.Session.restore(tmp_path)


def test_a_checkpoint_without_its_policy_is_damaged_and_the_root_falls_back(tmp_path):
    # the attack: with policy/ deleted, restore reported the checkpoint's step and metrics but held the initial
    # weights and a fresh optimizer
    with rl.Session(**SMALL, log_dir=None) as s:
        s.step()
        older = s.save(tmp_path)
        s.step()
        newer = s.save(tmp_path)
    assert json.loads((newer / "manifest.json").read_text())["parts"] == ["config.json", "policy", "reference",
                                                                            "session.pt"]
    shutil.rmtree(newer / "policy")
    assert checkpoints.damage(newer) == "step-000002/policy is missing"
    with pytest.raises(ValueError, match=r"the checkpoint .*step-000002 is damaged: step-000002/policy is missing; "
                                         r"restore the previous complete checkpoint, .*step-000001, instead"):
        rl.Session.restore(newer)
    with pytest.warns(UserWarning, match="skipping the damaged checkpoint .*step-000002: step-000002/policy is missing"):
        with rl.Session.restore(tmp_path) as r:
            assert r.step_count == 1 and checkpoints.step_of(older) == 1


def test_restoring_with_a_model_the_weights_do_not_fit_is_refused(tmp_path):
    # the attack: a 2-layer run restored with the 1-layer tiny-arith-small loaded the layer that fits, dropped the
    # other and carried on under the checkpoint's step count
    with rl.Session(**SMALL, log_dir=None) as s:
        s.step()
        folder = s.save(tmp_path)
    with pytest.raises(rl.policy.checkpoint.CheckpointError,
                       match=r"holds another model's weights: \d+ of its tensors are not in this model "
                             r"\(model\.layers\.1\..*Restore it with the model"):
        rl.Session.restore(folder, model="tiny-arith-small")


def test_a_restored_branch_gets_its_own_run_and_the_later_checkpoints_stay(tmp_path):
    # the attack: a run restored at an older step saved into the root of the abandoned timeline; keep_last counted by
    # step number and deleted the checkpoint just saved, and restore(root) then gave the abandoned timeline's last step
    # and rewrote metrics.jsonl with its rows
    settings = SMALL | dict(log_dir=str(tmp_path / "runs"), run_name="trunk", keep_last=2)
    with rl.Session(**settings, save_every=2) as s:
        s.run(6, progress=False)
    root = tmp_path / "runs" / "trunk" / "checkpoints"
    assert [p.name for p in checkpoints.step_dirs(root)] == ["step-000004", "step-000006"]
    with pytest.warns(UserWarning, match=r"restored step 4 of run trunk, whose checkpoints go on to step-000006: this "
                                         r"session is a branch, run 'trunk-from-4'"):
        branch = rl.Session.restore(root / "step-000004")
    with branch:
        assert (branch.run_name, branch.step_count) == ("trunk-from-4", 4)
        branch.step()
        saved = branch.save()
        assert saved.is_dir() and saved == tmp_path / "runs" / "trunk-from-4" / "checkpoints" / "step-000005"
    assert [p.name for p in checkpoints.step_dirs(root)] == ["step-000004", "step-000006"]  # the trunk as it was
    assert len((tmp_path / "runs" / "trunk" / "metrics.jsonl").read_text().splitlines()) == 6
    assert len((tmp_path / "runs" / "trunk-from-4" / "metrics.jsonl").read_text().splitlines()) == 5
    with rl.Session.restore(root) as trunk, rl.Session.restore(saved.parent) as twig:
        assert (trunk.run_name, trunk.step_count, twig.run_name, twig.step_count) == ("trunk", 6, "trunk-from-4", 5)


def test_a_save_dir_holds_one_runs_checkpoints(tmp_path):
    # the attack: two sessions with different run names and one save_dir: the second's save of a step replaced the
    # first's checkpoint, and keep_last deleted the other run's checkpoints too
    shared = str(tmp_path / "shared")
    with rl.Session(**SMALL, log_dir=None, run_name="first", save_dir=shared) as first:
        with pytest.raises(rl.runs.folders.RunFolderBusy, match=r"checkpoint folder \(save_dir\) .*shared is held by a "
                                                                r"live session: pid \d+"):
            rl.Session(**SMALL, log_dir=None, run_name="second", save_dir=shared)
        first.step()
        first.save()
    with rl.Session(**SMALL, log_dir=None, run_name="second", save_dir=shared) as second:
        second.step()
        with pytest.raises(ValueError, match=r"shared holds the checkpoints of run first, and a checkpoint folder holds "
                                             r"one run's"):
            second.save()
    assert [checkpoints.run_of(p) for p in checkpoints.step_dirs(shared)] == ["first"]


KILLED_MID_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
import rlbench as rl

root = sys.argv[1]
s = rl.Session(model="tiny-arith", cluster="inline", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
               threads=1, seed=5, log_dir=None)
s.step()
s.save(root)
s.step()
write_shards = dcp.save
def write_then_die(*args, **kwargs):  # the policy's shards are on disk, the checkpoint is not finished
    write_shards(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
dcp.save = write_then_die
s.save(root)
"""


def test_a_kill_during_save_leaves_the_last_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(root)], capture_output=True, text=True,
                         timeout=300, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    leftovers = sorted(p.name for p in root.iterdir())
    assert leftovers[0].startswith(".step-000002.partial-") and leftovers[1:] == ["step-000001"]
    with rl.Session.restore(root, log_dir=None) as r:
        assert r.step_count == 1
        r.step()
        r.save(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]  # the stray folder is gone


def test_export_loads_in_transformers_with_the_same_greedy_completions(tmp_path):
    with rl.Session(**SMALL) as s:
        s.run(3, progress=False)
        folder = s.export(tmp_path / "model")
        prompts = [e["prompt"] for e in s.task.test[:32]]
        expected = s.complete(prompts)
    model, tokenizer = rl.models.load(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ids = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completions == expected
    with rl.Session(**(SMALL | dict(model=str(folder)))) as again:  # and rlbench takes it as a model
        assert again.complete(prompts) == expected


def _nan_advantages(batch):
    return batch.with_columns(advantages=batch["advantages"] * float("nan"))


def test_a_non_finite_loss_skips_the_step_and_keeps_the_weights():
    with rl.Session(**SMALL) as s:
        s.step()
        before = {k: v.clone() for k, v in s.policy.state_dict().items()}
        stats = s.update(_nan_advantages(s.advantage(s.score(s.rollout()))))
        after = s.policy.state_dict()
        assert (stats["skipped"], stats["nonfinite_loss"]) == (1.0, 1.0)
        assert all(torch.equal(before[k], after[k]) for k in before)
        s.step()  # and training goes on from there
        assert s.metrics["skipped"].iloc[-1] == 0.0


def test_too_many_skipped_steps_stop_the_run_naming_the_reason():
    class NanAdvantages(rl.Session):
        def advantage(self, batch):
            return _nan_advantages(super().advantage(batch))

    with NanAdvantages(**SMALL, max_skipped_updates=2) as s:
        with pytest.warns(UserWarning, match="step 0: optimizer step skipped \\(non-finite loss\\)"):
            with pytest.raises(FloatingPointError, match="3 optimizer steps were skipped .* max_skipped_updates=2"):
                s.run(10, progress=False)
        assert s.skipped_updates == [{"step": i, "reason": "non-finite loss"} for i in range(3)]
        assert len(s.metrics) == 3  # every step is recorded, the one that stopped the run too
