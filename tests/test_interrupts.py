"""Ctrl-C during run(): the step in progress finishes and is recorded, so the bookkeeping always agrees.

Real signals into a real subprocess: 50 SIGINTs at random times, then the invariants (steps recorded = optimizer
steps = log lines, data position, sampler weights = policy weights) and a save / restore that continues bit for
bit; and a double Ctrl-C that stops at once and makes the session refuse to go on.
"""

import json
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

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


def start(tmp_path, overlap: bool) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "runs"), str(tmp_path / "done"),
                              "1" if overlap else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path)
    return child


def wait_for(child: subprocess.Popen, line: str) -> None:
    """Read the child's lines up to `line` (its steps print "step")."""
    while (got := child.stdout.readline()) and got.strip() != line:
        pass
    assert got, f"the child ended before printing {line!r}: {child.stderr.read()[-3000:]}"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_fifty_interrupts_leave_the_bookkeeping_whole(tmp_path, overlap):
    times = random.Random(0)
    child = start(tmp_path, overlap)
    try:
        for i in range(50):  # each signal once the last one was handled and a step has run since: one Ctrl-C each
            wait_for(child, "interrupted" if i else "ready")
            wait_for(child, "step")
            time.sleep(times.uniform(0.0, 0.3))  # anywhere in a step, or between two
            if i == 49:
                (tmp_path / "done").touch()
            child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
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
        s.score = lambda batch: (time.sleep(3), slow_score(batch))[1]
        print("ready", flush=True)
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
        assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
        time.sleep(1.0)
        child.send_signal(signal.SIGINT)
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert "aborted: interrupted twice during step 0" in out, err[-2000:]
    assert "refused: interrupted twice" in out and "Session.restore" in out
    assert "save refused: save: interrupted twice during step 0" in out
    assert not (tmp_path / "checkpoints").exists()
    assert "finishing step 0 before stopping" in err
