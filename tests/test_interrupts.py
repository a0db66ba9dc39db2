"""Ctrl-C during run(), a step, a save or an update: what is in progress finishes first, so the bookkeeping always
agrees and every checkpoint is whole.

Real signals into a real subprocess: 50 SIGINTs at random times, then the invariants (steps recorded = optimizer
steps = log lines, data position, sampler weights = policy weights) and a save / restore that continues bit for
bit; and a double Ctrl-C that stops at once and makes the session refuse to go on. The same for saves (50 SIGINTs,
then every checkpoint whole and the newest restoring the weights it was saved with) and for an update called by
hand (its gradients never leak into the next one). And, in this process, how guarded blocks nest (an update inside a
step, a save inside either).
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlbench import interrupts

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import rlbench as rl

    log_dir, done, overlap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    settings = dict(model="tiny-arith", task="arithmetic", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
                    cluster="inline", seed=0, threads=1, log_dir=log_dir, overlap_rollout=overlap)
    s = rl.Session(**settings, run_name="interrupted")
    s.callbacks.append(lambda session, row: print("step", flush=True))  # the test signals only inside run()
    print("ready", flush=True)
    interrupts = 0
    while True:
        try:
            s.run(10**6, progress=False)
        except KeyboardInterrupt:
            interrupts += 1
            if os.path.exists(done):
                break
            print("interrupted", flush=True)
    policy = s.policy.workers.hosts[0].objects["policy"]
    pending = hasattr(s.source, "prefetch") and s.source.prefetch.pending() is not None  # rl.Overlap only
    sampler, weights = s.sampler.state_dict(), s.policy.state_dict()
    lines = len(open(os.path.join(log_dir, "interrupted", "metrics.jsonl")).read().splitlines())
    facts = dict(interrupts=interrupts, steps=s.step_count, history=len(s.history), log_lines=lines,
                 optimizer_steps=policy.optimizer.scheduler.last_epoch, examples_seen=s.state.examples_seen,
                 rollouts_done=s.state.rollouts_done, pending=pending,
                 sampler_is_policy=all(torch.equal(sampler[k], weights[k]) for k in weights if k in sampler))
    path = s.save()
    first = s.run(3, progress=False).iloc[-3:]
    s.close()
    with rl.Session.restore(path) as again:
        second = again.run(3, progress=False).iloc[-3:]
    numbers = [c for c in first.columns if not c.startswith("time_")]
    facts["resumed_bit_for_bit"] = first[numbers].reset_index(drop=True).equals(second[numbers].reset_index(drop=True))
    print(json.dumps(facts), flush=True)
""")


def start(tmp_path, code: str, *args: str) -> subprocess.Popen:
    """Run `code` in a new Python process (in `tmp_path`, with `args` as its sys.argv[1:])."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)


def wait_for(child: subprocess.Popen, line: str) -> list[str]:
    """Read the child's lines up to `line` (its steps print "step"); return those before it."""
    before = []
    while (got := child.stdout.readline()) and got.strip() != line:
        before.append(got.strip())
    assert got, f"the child ended before printing {line!r}: {child.stderr.read()[-3000:]}"
    return before


def said(child: subprocess.Popen, text: str) -> str:
    """Read the child's stderr up to the line holding `text` (rlbench's "finishing ... before stopping": a Ctrl-C
    was handled); that line."""
    while got := child.stderr.readline():
        if text in got:
            return got
    raise AssertionError(f"the child ended before saying {text!r}: {child.stdout.read()[-3000:]}")


def fifty_interrupts(child: subprocess.Popen, done: Path, *, after: list[tuple[str, float]]) -> tuple[str, str]:
    """Send the child 50 SIGINTs, each once it handled the last one and printed a line since (one Ctrl-C at a
    time): the i-th after `after[i % len(after)]` = (line, seconds), at a random moment up to that many seconds
    later; the 50th after touching `done`. Its (stdout, stderr) once it ends."""
    times = random.Random(0)
    try:
        for i in range(50):
            wait_for(child, "interrupted" if i else "ready")
            line, seconds = after[i % len(after)]
            wait_for(child, line)
            time.sleep(times.uniform(0.0, seconds))
            if i == 49:
                done.touch()
            child.send_signal(signal.SIGINT)
        return child.communicate(timeout=300)
    finally:
        child.kill()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_fifty_interrupts_leave_the_bookkeeping_whole(tmp_path, overlap):
    child = start(tmp_path, CHILD, str(tmp_path / "runs"), str(tmp_path / "done"), "1" if overlap else "0")
    out, err = fifty_interrupts(child, tmp_path / "done", after=[("step", 0.3)])
    assert child.returncode == 0, err[-3000:]
    facts = json.loads(out.strip().splitlines()[-1])
    steps = facts["steps"]
    assert facts["interrupts"] == 50 and steps > 50
    assert facts["history"] == facts["log_lines"] == facts["optimizer_steps"] == steps
    ahead = 1 if facts["pending"] else 0  # overlap_rollout: the next step's batch is already drawn
    assert (facts["examples_seen"], facts["rollouts_done"]) == (4 * (steps + ahead), steps + ahead)
    assert facts["sampler_is_policy"] and facts["resumed_bit_for_bit"]


def test_a_second_interrupt_within_a_second_stops_at_once_and_the_session_refuses_to_go_on(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        import rlbench as rl
        s = rl.Session(model="tiny-arith", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, cluster="inline",
                       log_dir=None, threads=1, save_dir=sys.argv[1])
        slow_score = s.score
        s.score = lambda batch: (print("scoring", flush=True), time.sleep(3600), slow_score(batch))[2]
        try:
            s.step()
        except rl.interrupts.StepAborted as error:
            print("aborted:", error, flush=True)
        try:
            s.step()
        except RuntimeError as error:
            print("refused:", error, flush=True)
        try:  # the attack: save() wrote the aborted state over the checkpoint the message sends the user back to
            s.save()
        except RuntimeError as error:
            print("save refused:", error, flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "checkpoints")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_for(child, "scoring")  # inside step 0, which would take an hour
        child.send_signal(signal.SIGINT)
        said(child, "finishing step 0 before stopping")
        child.send_signal(signal.SIGINT)  # as soon as the first was handled: within its second
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert "aborted: interrupted twice during step 0" in out, err[-2000:]
    assert "refused: interrupted twice" in out and "Session.restore" in out
    assert "save refused: save: interrupted twice during step 0" in out
    assert not list((tmp_path / "checkpoints").glob("*step-*"))  # (the folder holds the open session's .lock)


SAVER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import rlbench as rl
    from rlbench.runs import checkpoints

    root, done = Path(sys.argv[1]), sys.argv[2]
    s = rl.Session(model="tiny-arith", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, cluster="inline",
                   seed=0, threads=1, log_dir=None, save_dir=str(root), keep_last=2)
    weights = {}  # the policy's weights after each of the last steps: what their checkpoints must restore
    said = []
    print("ready", flush=True)
    while True:  # a notebook's cell, run again after each Ctrl-C
        try:
            while True:
                s.step()
                weights = {k: v for k, v in weights.items() if k > s.step_count - 3}
                weights[s.step_count] = {k: v.clone() for k, v in s.policy.state_dict().items()}
                print("saving", flush=True)
                s.save()
                print("saved", flush=True)
        except KeyboardInterrupt as error:
            said.append(str(error))
            if os.path.exists(done):
                break
            print("interrupted", flush=True)
    folders = checkpoints.step_dirs(root)
    facts = dict(said=said, folders=[f.name for f in folders], damage=[checkpoints.damage(f) for f in folders],
                 leftovers=sorted(p.name for p in root.glob(".step-*")))  # a partial folder
    s.close()  # (its checkpoint folder is its own while it is open)
    with rl.Session.restore(root) as again:
        restored, saved = again.policy.state_dict(), weights.get(again.step_count, {})
        facts["restored_step"] = again.step_count
        facts["restores_its_weights"] = restored.keys() == saved.keys() and all(
            torch.equal(restored[k], saved[k]) for k in restored)
        again.step()
    print(json.dumps(facts), flush=True)
""")


def test_fifty_interrupts_during_saves_leave_every_checkpoint_whole(tmp_path):
    """The attack: a Ctrl-C inside torch's zip writer aborted the whole process (`terminate called after throwing an
    instance of 'pybind11::error_already_set'`, exit 134: a notebook's kernel dies), or was reported as a full disk."""
    child = start(tmp_path, SAVER, str(tmp_path / "checkpoints"), str(tmp_path / "done"))
    # every other Ctrl-C anywhere in a step and its save; the others early in a save (which takes 0.1 s or more)
    out, err = fifty_interrupts(child, tmp_path / "done", after=[("saved", 0.3), ("saving", 0.05)])
    assert child.returncode == 0, err[-3000:]
    facts = json.loads(out.strip().splitlines()[-1])
    assert len(facts["said"]) == 50
    during_saves = [m for m in facts["said"] if m.startswith("interrupted: the save of step")]
    assert len(during_saves) >= 10, facts["said"]  # the signals did land in saves
    assert all(m.endswith("finished first") for m in during_saves)
    assert len(facts["folders"]) == 2 and facts["damage"] == [None, None] and facts["leftovers"] == []
    assert facts["restored_step"] == int(facts["folders"][-1].removeprefix("step-"))
    assert facts["restores_its_weights"]


def test_a_double_interrupt_during_a_save_lets_it_finish(tmp_path):
    """A save is never stopped midway (that would cut a file torch is writing): both Ctrl-Cs wait for it."""
    code = textwrap.dedent("""
        import os, sys, time
        import rlbench as rl
        from rlbench.runs import checkpoints
        s = rl.Session(model="tiny-arith", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, cluster="inline",
                       log_dir=None, threads=1, save_dir=sys.argv[1])
        s.step()
        write = s.state.save

        def held(path):  # a save that waits, inside, for the test's two Ctrl-Cs
            print("saving", flush=True)
            while not os.path.exists(sys.argv[2]):
                time.sleep(0.01)
            write(path)

        s.state.save = held
        try:
            s.save()
        except KeyboardInterrupt as error:
            print("interrupted:", error, flush=True)
        print("damage:", checkpoints.damage(checkpoints.step_dirs(sys.argv[1])[-1]), flush=True)
        s.step()
        print("went on", flush=True)
    """)
    child = start(tmp_path, code, str(tmp_path / "checkpoints"), str(tmp_path / "go"))
    try:
        wait_for(child, "saving")
        held = []
        for _ in range(2):
            child.send_signal(signal.SIGINT)
            held.append(said(child, "finishing the save of step 1 before stopping"))
        (tmp_path / "go").touch()
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    assert "interrupted: interrupted: the save of step 1 finished first" in out
    assert "damage: None" in out and "went on" in out
    assert "it cannot be stopped midway" in held[1]


def test_an_interrupt_during_run_still_writes_the_checkpoint_due_after_the_step(tmp_path):
    """The attack: with save_every, a Ctrl-C during the step before a save stopped after the step, and its checkpoint
    was never written."""
    code = textwrap.dedent("""
        import os, sys, time
        import rlbench as rl
        from rlbench.runs import checkpoints
        s = rl.Session(model="tiny-arith", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, cluster="inline",
                       log_dir=None, threads=1, save_dir=sys.argv[1], save_every=1)
        score = s.score

        def held(batch):  # step 0's scoring waits for the test's Ctrl-C
            print("scoring", flush=True)
            while not os.path.exists(sys.argv[2]):
                time.sleep(0.01)
            return score(batch)

        s.score = held
        try:
            s.run(3, progress=False)
        except KeyboardInterrupt as error:
            print("interrupted:", error, flush=True)
        print("steps:", s.step_count, [f.name for f in checkpoints.step_dirs(sys.argv[1])], flush=True)
    """)
    child = start(tmp_path, code, str(tmp_path / "checkpoints"), str(tmp_path / "go"))
    try:
        wait_for(child, "scoring")
        child.send_signal(signal.SIGINT)
        said(child, "rlbench: finishing step 0")
        (tmp_path / "go").touch()
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    assert "interrupted: interrupted: step 0 and its checkpoint finished first" in out
    assert "steps: 1 ['step-000001']" in out


UPDATER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import rlbench as rl

    # 128 rows of one sequence per micro-batch (each on its own: a packed micro-batch counts a group's prompt once,
    # and two rows would fit): an update of many micro-batches
    settings = dict(model="tiny-arith", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, cluster="inline",
                    seed=0, threads=1, log_dir=None, micro_batch_tokens=16, attention="per_sample",
                    save_dir=sys.argv[1])
    s, twin = rl.Session(**settings), rl.Session(**settings | {"save_dir": None})
    batch = s.advantage(s.collect())
    held = {"until": None, "backwards": 0}

    def hold():  # in an update the test holds, the second micro-batch waits (its first's gradients in) for a file
        held["backwards"] += 1
        if held["until"] and held["backwards"] == 2:
            print("mid-update", flush=True)
            while not os.path.exists(held["until"]):
                time.sleep(0.01)

    s.policy.workers.hosts[0].objects["policy"].set_before_backward(hold)

    def updating(until):
        held.update(until=os.path.join(sys.argv[2], until), backwards=0)
        print("updating", flush=True)

    updating("go-1")
    try:
        s.update(batch)
    except KeyboardInterrupt as error:
        print("interrupted:", error, flush=True)
    held["until"] = None
    twin.update(batch)  # the same update, not interrupted
    # (both again on the batch each trained on): the attack was a cut update that left its gradients to this one
    ours, theirs = s.update(batch, again=True), twin.update(batch, again=True)
    weights, twin_weights = s.policy.state_dict(), twin.policy.state_dict()
    print(json.dumps(dict(grad_norms=[ours["grad_norm"], theirs["grad_norm"]],
                          same_weights=all(torch.equal(weights[k], twin_weights[k]) for k in weights))), flush=True)
    updating("go-2")  # (never there: the second Ctrl-C stops the update)
    try:
        s.update(batch, again=True)
    except rl.interrupts.StepAborted as error:
        print("aborted:", error, flush=True)
    for stage in (lambda: s.update(batch), s.step, s.save):
        try:
            stage()
        except RuntimeError as error:
            print("refused:", error, flush=True)
""")


def test_an_interrupt_during_an_update_lets_it_finish_and_a_second_one_stops_it_for_good(tmp_path):
    """`s.update(batch)` in a cell: the attack was a Ctrl-C between micro-batches, which left their gradients in
    `.grad` for the next update to add to its own (another grad norm, other weights, no warning)."""
    child = start(tmp_path, UPDATER, str(tmp_path / "checkpoints"), str(tmp_path))
    try:
        wait_for(child, "mid-update")
        child.send_signal(signal.SIGINT)
        said(child, "finishing the update before stopping")
        (tmp_path / "go-1").touch()
        first = wait_for(child, "updating")
        wait_for(child, "mid-update")
        child.send_signal(signal.SIGINT)
        said(child, "finishing the update before stopping")
        child.send_signal(signal.SIGINT)  # as soon as the first was handled: within its second
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    assert first[0] == "interrupted: interrupted: the update finished first", first
    facts = json.loads(first[1])
    ours, theirs = facts["grad_norms"]
    assert ours == theirs and facts["same_weights"]  # exactly: the same computation on the same numbers
    assert "aborted: interrupted twice during the update" in out
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert [r.split(":")[1].strip() for r in refusals] == ["update", "interrupted twice during the update",
                                                          "save"]
    assert not list((tmp_path / "checkpoints").glob("*step-*"))  # no checkpoint, whole or partial


def ctrl_c() -> None:
    """A SIGINT to this process, handled (as a Ctrl-C is) before the next line runs."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)


def test_a_block_inside_another_holds_its_ctrl_c_for_the_outer_one_and_only_says_whether_it_may_stop():
    """step() calls update() inside its own block: a Ctrl-C during the update must not stop the step after the update
    (before its weights reach the sampler and it is recorded), but once, at the end of the step."""
    done, handler = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match="^interrupted: step 3 finished first$"):
        with interrupts.finishes_first("step 3"):
            with interrupts.finishes_first("the update"):
                ctrl_c()
                done.append("update")
            done.append("recorded")
    assert done == ["update", "recorded"]
    # a save inside a step (a callback's) is never stopped midway; around it, the step may be
    with pytest.raises(interrupts.StepAborted, match="interrupted twice during step 4"):
        with interrupts.finishes_first("step 4"):
            with interrupts.finishes_first("the save of step 4", abortable=False):
                ctrl_c()
                ctrl_c()
                done.append("saved")
            ctrl_c()
            done.append("not reached")
    assert done[2:] == ["saved"]
    assert signal.getsignal(signal.SIGINT) is handler
