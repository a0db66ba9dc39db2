"""A notebook user's habits, as attacks (issue 69): a cell run again, a restore only to look, a restore from an earlier
step under the run's own name, files with bad rows, a reward that writes into its example, steps by hand, a second
call while a background run trains. Each asserts the careful behaviour: nothing lost, nothing mixed, a clear error."""

import copy
import json
import threading
from pathlib import Path

import pytest

import rlbench as rl
from rlbench.runs import checkpoints
from rlbench.runs.sinks import read_jsonl

SMALL = dict(model="tiny-arith", task="arithmetic", cluster="inline", prompts_per_step=2, samples_per_prompt=2,
             max_new_tokens=6, threads=1)


def steps_logged(folder: Path) -> list[int]:
    return read_jsonl(folder / "metrics.jsonl")["step"].tolist()


def saved_seed(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["seed"]


def test_a_cell_run_again_is_a_new_run_and_the_first_stays_whole():
    """The attack: the same cell run again with another seed and lr appended to the first run's metrics.jsonl (steps
    0, 1, 2, 3, 0, 1) and replaced its step-000002 checkpoint (its config then said seed 1)."""
    with rl.Session(**SMALL, run_name="exp1", save_every=2) as first:
        first.run(4, progress=False)
    with pytest.warns(UserWarning, match=r"run folder runs/exp1 holds an earlier run: this session is run 'exp1-2' "
                                         r"\(runs/exp1-2\); to go on with the earlier one, "
                                         r"rl.Session.restore\('runs/exp1/checkpoints'\)"):
        again = rl.Session(**SMALL, run_name="exp1", save_every=2, seed=1, lr=3e-4)
    with again:
        assert again.run_name == again.config.run_name == "exp1-2"
        again.run(2, progress=False)
    run = Path("runs/exp1")
    assert steps_logged(run) == [0, 1, 2, 3] and steps_logged(Path("runs/exp1-2")) == [0, 1]
    assert [saved_seed(f) for f in checkpoints.step_dirs(run / "checkpoints")] == [0, 0]
    assert [saved_seed(f) for f in checkpoints.step_dirs(Path("runs/exp1-2/checkpoints"))] == [1]
    with rl.Session.restore(run / "checkpoints") as restored:  # going on with the first: its own folder, no warning
        assert (restored.run_name, restored.step_count) == ("exp1", 4)


def test_a_restore_only_to_look_changes_nothing_and_redone_steps_are_kept_aside():
    """The attack: a run saved at step 2 that logged steps 0-4; `Session.restore(latest)` alone, no step taken, cut
    metrics.jsonl to steps 0-1. Now the log is cut only when the restored session logs a step of its own, and the rows
    it redoes go to metrics.superseded.jsonl."""
    with rl.Session(**SMALL, run_name="crashed") as s:
        s.run(2, progress=False)
        s.save()
        s.run(3, progress=False)  # steps 2-4, no later checkpoint: as if it crashed after step 4
    run = Path("runs/crashed")
    before = (run / "metrics.jsonl").read_text()
    assert steps_logged(run) == [0, 1, 2, 3, 4]
    with rl.Session.restore(run / "checkpoints") as looked:
        assert looked.step_count == 2 and looked.metrics["step"].tolist() == [0, 1]
    assert (run / "metrics.jsonl").read_text() == before and not (run / "metrics.superseded.jsonl").exists()
    with rl.Session.restore(run / "checkpoints") as going_on:
        going_on.step()
    assert steps_logged(run) == [0, 1, 2]
    assert (run / "metrics.superseded.jsonl").read_text() == "".join(before.splitlines(keepends=True)[2:])


def test_restoring_an_earlier_step_under_the_runs_own_name_is_refused():
    """The attack: `restore(step-000002, run_name=<the same run>)` then `run(2)` replaced the run's later
    step-000004 and its metrics. Without run_name the session is a branch of its own (as before)."""
    with rl.Session(**SMALL, run_name="trunk", save_every=2) as s:
        s.run(4, progress=False)
    root = Path("runs/trunk/checkpoints")
    with pytest.raises(ValueError, match=r"restore: run_name='trunk' would go on from step 2 in run trunk's own "
                                         r"folder, over its later checkpoints \(up to step-000004\) and their metrics: "
                                         r"leave run_name out \(the session is then a branch, trunk-from-2"):
        rl.Session.restore(root / "step-000002", run_name="trunk")
    with pytest.warns(UserWarning, match="this session is a branch, run 'trunk-from-2'"):
        branch = rl.Session.restore(root / "step-000002")
    with branch:
        branch.run(2, progress=False)
    assert steps_logged(Path("runs/trunk")) == [0, 1, 2, 3] and steps_logged(Path("runs/trunk-from-2")) == [0, 1, 2, 3]
    assert [f.name for f in checkpoints.step_dirs(root)] == ["step-000002", "step-000004"]


def test_a_restore_under_another_name_that_holds_a_run_is_a_run_of_its_own():
    with rl.Session(**SMALL, run_name="a", save_every=2) as s:
        s.run(2, progress=False)
    with rl.Session(**SMALL, run_name="b") as other:
        other.run(1, progress=False)
    with pytest.warns(UserWarning, match=r"run folder runs/b holds an earlier run: this session is run 'b-2'"):
        restored = rl.Session.restore("runs/a/checkpoints", run_name="b")
    with restored:
        assert restored.run_name == "b-2"
        restored.step()
    assert steps_logged(Path("runs/b")) == [0] and steps_logged(Path("runs/b-2")) == [0, 1, 2]


# ------------------------------------------------------------------------------------------ data checked at load
def gsm8k_row(question: str, truth) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


@pytest.mark.parametrize("truth, reason", [
    (None, r"'reward_model.ground_truth' is None: there is no reference answer"),
    (float("nan"), r"'reward_model.ground_truth' is nan: there is no reference answer"),
    (["72", "73"], r"'reward_model.ground_truth' is \['72', '73'\] \(list\): the openai/gsm8k grader compares the "
                   r"final answer with a string or a number"),
], ids=["null", "nan", "list"])
def test_a_ground_truth_the_grader_cannot_use_is_refused_naming_the_row(tmp_path, truth, reason):
    """The attack: null, NaN or list ground truths were accepted; every sample scored 0 with no reward error."""
    rows = [gsm8k_row(f"q{i}", "72") for i in range(4)]
    rows[2] = gsm8k_row("q2", truth)
    path = rl.tasks.write_rows(rows, tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match=rf"row 2 of {path}: {reason}"):
        rl.tasks.from_jsonl(path)


def test_repeated_prompts_are_counted_and_dropped_or_refused_by_choice(tmp_path):
    """The attack: a file with duplicated rows, split with test=0.2, put 18 of 20 held-out prompts in training, unsaid;
    a separate test file holding training rows likewise."""
    rows = [gsm8k_row(f"q{i % 50}", str(i % 50)) for i in range(100)]  # every prompt twice
    path = rl.tasks.write_rows(rows, tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match=rf"{path}: 50 of its 100 rows repeat an earlier row's prompt \(row 50 = row 0, "
                                         r"row 51 = row 1, row 52 = row 2, row 53 = row 3, row 54 = row 4, \.\.\.\)"):
        rl.tasks.from_jsonl(path, test=0.2)
    task = rl.tasks.from_jsonl(path, test=0.2, duplicates="drop")
    train, test = ({json.dumps(e["prompt"]) for e in split} for split in (task.train, task.test))
    assert (len(task.train), len(task.test), len(train), train & test) == (40, 10, 40, set())
    assert len(rl.tasks.from_jsonl(path, test=0.2, duplicates="keep").train) == 80

    test_path = rl.tasks.write_rows([gsm8k_row(f"q{i}", str(i)) for i in (3, 7, 60)], tmp_path / "test.jsonl")
    unique = rl.tasks.write_rows(rows[:50], tmp_path / "unique.jsonl")
    with pytest.raises(ValueError, match=rf"{unique}: 2 of its 50 rows have the prompt of a row of the test set "
                                         rf"{test_path} \(row 3 = test row 0, row 7 = test row 1\): held-out accuracy"):
        rl.tasks.from_jsonl(unique, test=test_path)
    assert len(rl.tasks.from_jsonl(unique, test=test_path, duplicates="drop").train) == 48
    with pytest.raises(ValueError, match=r"duplicates must be one of 'refuse', 'drop', 'keep', got 'skip'"):
        rl.tasks.from_jsonl(unique, duplicates="skip")


@pytest.mark.parametrize("line, reason", [
    (b'{"data_source": "openai/gsm8k", "prompt": "q\xff"}', r"not UTF-8 text \(byte b'\\xff' at column 45\)"),
    (b'{"data_source": "openai/gsm8k", "prompt": "q', r"not JSON \(Unterminated string starting at: column 43, near 'i/gsm8k\", \"prompt\": \"q'\)"),
], ids=["bad-byte", "cut-short"])
def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path, line, reason):
    good = json.dumps(gsm8k_row("q", "1")).encode()
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join([good, good, b"", line, good]) + b"\n")
    with pytest.raises(ValueError, match=rf"{path}, line 4: {reason}"):
        rl.tasks.from_jsonl(path)


def test_a_task_that_is_not_one_is_said_in_one_short_message():
    """The attack: a list of 5,000 examples as task= put the whole data set (95k characters) in the TypeError."""
    examples = [{"prompt": "x" * 1000, "answer": "1"}] * 5000
    with pytest.raises(TypeError, match=r"task= got a list, \[\{'answer': '1', 'prompt': 'x+\.\.\.x+'\}, .*\]: a task "
                                        r"is a built-in task's name \(arithmetic, ") as error:
        rl.Session(model="tiny-arith", task=examples, log_dir=None)
    assert len(str(error.value)) < 500


# ------------------------------------------------------------------------------------------- rewards
class Scribbling(rl.tasks.Arithmetic):
    """Arithmetic whose reward writes into the example it grades (and into a nested part of it)."""

    def reward(self, completion, example):
        example["answer"] = "scribbled"
        example.setdefault("seen", []).append(completion)
        return 0.0


def test_a_reward_that_writes_into_its_example_changes_neither_the_task_nor_the_next_sample():
    """The attack: a reward that wrote into its example corrupted `task.train` in memory."""
    task = Scribbling()
    before = copy.deepcopy(task.train)
    with rl.Session(**SMALL | dict(task=task), log_dir=None) as s:
        batch = s.score(s.rollout())
        assert batch["reward_error"] == [None] * len(batch)
        assert [e["answer"] for e in batch["example"]] == [str(e["a"] + e["b"]) for e in batch["example"]]
    assert task.train == before
    pictures = [object()]  # shared with the copy, never copied: pictures are read, and large
    seen = []
    rl.rewards.score_all(lambda c, e: seen.append(e) or 1.0, ["a", "b"], [{"images": pictures, "n": [1]}] * 2)
    assert seen[0]["images"][0] is pictures[0] and seen[0]["n"] is not seen[1]["n"]


# -------------------------------------------------------------------------------------------- hand steps
def test_hand_steps_are_counted_logged_and_saved_under_their_own_steps():
    """The attack: the README's four cells left step_count 0 and no metrics row; two hand steps both saved to
    step-000000, the second over the first; `update(batch)` run twice on one batch (Shift-Enter twice) trained on it
    again, silently."""
    with rl.Session(**SMALL, run_name="by-hand") as s:
        saved = []
        for _ in range(2):
            batch = s.advantage(s.score(s.rollout()))
            s.update(batch)
            saved.append(s.save().name)
        with pytest.raises(ValueError, match=r"this batch already trained the policy, at step 1"):
            s.update(batch)
        assert s.step_count == 2 and saved == ["step-000001", "step-000002"]
    assert steps_logged(Path("runs/by-hand")) == [0, 1]
    with rl.Session.restore("runs/by-hand/checkpoints") as restored:
        assert restored.step_count == 2


# ------------------------------------------------------------------------------------------ one call at a time
def test_a_second_call_while_a_background_run_trains_is_refused_saying_how_to_wait_or_stop():
    """The attack: while `run()` trained in a background thread (the dashboard's way), another cell's `s.step()` or
    `s.evaluate()` was accepted; the two shared the sampler's decoder cache (the run died in 2 of 4 trials, and one
    recorded step trained on a corrupted rollout)."""
    with rl.Session(**SMALL, log_dir=None) as s:
        inside, tried = threading.Event(), threading.Event()

        def hold(session, row):  # the run's first step is recorded; its thread waits here for the other calls
            inside.set()
            assert tried.wait(60)

        s.callbacks.append(hold)
        run = threading.Thread(target=lambda: s.run(3, progress=False), name="background-run")
        run.start()
        assert inside.wait(120)
        for call in (s.step, s.evaluate, s.rollout, lambda: s.save("elsewhere")):
            with pytest.raises(RuntimeError, match=r": the session is busy with run\(\) in thread 'background-run' "
                                                   r".* session.request_stop\(\)"):
                call()
        s.request_stop()
        tried.set()
        run.join(120)
        assert not run.is_alive() and s.step_count == 1  # it stopped after the step in progress
        s.callbacks.clear()
        assert s.step()["step"] == 1  # the session is free again


# ---------------------------------------------------------------------------------------- what a restore changes
def test_a_restore_that_changes_what_is_trained_says_so_and_records_it():
    """The attack: restoring with another seed, another dataset of the same size or another algorithm continued the
    same run and log with no warning and no record; with a new seed mid-epoch, 10 of 40 examples were drawn twice in
    the epoch."""
    examples = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 50)]  # 40: an epoch is 5 steps of 8
    task = rl.tasks.DataTask("doubles", train=tuple(examples), test=tuple(examples[:4]),
                             reward=lambda completion, example: float(completion == example["answer"]))
    settings = SMALL | dict(task=task, prompts_per_step=8, samples_per_prompt=2, run_name="doubles")
    drawn = []
    with rl.Session(**settings) as s:
        for _ in range(2):  # 16 of the epoch's 40 examples
            drawn += [e["prompt"] for e in s.rollout()["example"][::2]]
        s.save()
    other = rl.tasks.DataTask("doubles", train=tuple(dict(e, answer="0") for e in examples), test=task.test,
                              reward=task.reward)
    with pytest.warns(UserWarning, match=r"restored step 0 of run doubles with other settings than its checkpoint's: "
                                         r"seed 0 -> 1; lr 0.0001 -> 0.0003; task data '.*' -> '.*'\. The run goes on "
                                         r"with them, and records them .*: the data order takes the new seed from the "
                                         r"next epoch on"):
        restored = rl.Session.restore("runs/doubles/checkpoints", task=other, seed=1, lr=3e-4)
    with restored:
        assert [(c["setting"], c["from"], c["to"]) for c in restored.state.changes][:2] == [("seed", 0, 1),
                                                                                          ("lr", 1e-4, 3e-4)]
        for _ in range(3):  # the rest of the first epoch: 24 more examples, none drawn before in it
            drawn += [e["prompt"] for e in restored.rollout()["example"][::2]]
        folder = restored.save()
    assert sorted(drawn) == sorted(e["prompt"] for e in examples)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [c["setting"] for c in manifest["changes"]] == ["seed", "lr", "task data"]
    with rl.Session.restore(folder, task=other) as again:  # the settings it was saved with: nothing new to say
        assert len(again.state.changes) == 3
