"""The reward runner: parallel scoring with a timeout; every failure recorded with the sample and the reason."""

import math
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

from rlbench.rewards import RewardError, Scores, batched, score_all

COMPLETIONS = ["46", "47", "hang", "oops"]
EXAMPLES = [{"answer": "46"}, {"answer": "47"}, {"answer": "1"}, {"answer": "2"}]
MODES = [dict(), dict(workers=3, timeout_s=5.0), dict(workers=2, timeout_s=5.0, processes=True)]
"""serial in the caller; threads; forked processes."""


def exact(completion, example):
    return {"score": float(completion == example["answer"]), "acc": float(completion == example["answer"])}


@pytest.mark.parametrize("mode", MODES, ids=["serial", "threads", "processes"])
def test_valid_rewards_in_every_mode(mode):
    scores = score_all(exact, COMPLETIONS, EXAMPLES, **mode)
    assert scores == Scores(score=[1.0, 1.0, 0.0, 0.0], components={"acc": [1.0, 1.0, 0.0, 0.0]},
                            error=[None] * 4)
    assert scores.failed == []


def _fails_on_sample_3(value):
    def reward(completion, example):
        return value(completion) if completion == "oops" else 1.0
    return reward


def _raise(completion):
    raise ZeroDivisionError(f"cannot score {completion!r}")


FAILURES = [  # (what the reward does on sample 3, the reason recorded)
    (_raise, "ZeroDivisionError: cannot score 'oops'"),
    (lambda c: float("nan"), "reward 'score' is nan"),
    (lambda c: math.inf, "reward 'score' is inf"),
    (lambda c: "1.0", "reward 'score' must be a number, got str '1.0'"),
    (lambda c: None, "reward 'score' must be a number, got NoneType None"),
    (lambda c: {"acc": 1.0}, "a dict reward needs a 'score' key, got keys ['acc']"),
    (lambda c: {"score": 1.0, "acc": "yes"}, "reward 'acc' must be a number, got str 'yes'"),
]


@pytest.mark.parametrize("mode", MODES, ids=["serial", "threads", "processes"])
@pytest.mark.parametrize(("value", "reason"), FAILURES, ids=[r.split(":")[0][:24] for _, r in FAILURES])
def test_failures_are_recorded_with_the_reason(mode, value, reason):
    scores = score_all(_fails_on_sample_3(value), COMPLETIONS, EXAMPLES, on_error="zero", **mode)
    assert scores.score == [1.0, 1.0, 1.0, 0.0]
    assert scores.error == [None, None, None, reason] and scores.failed == [3]
    with pytest.raises(RewardError) as raised:
        score_all(_fails_on_sample_3(value), COMPLETIONS, EXAMPLES, **mode)
    assert str(raised.value) == f"reward failed on sample 3 (completion 'oops'): {reason}"


def test_bool_int_and_numpy_scores_are_numbers():
    scores = score_all(lambda c, e: [True, 2, np.float32(0.5), np.int64(3)][int(c)], list("0123"), [{}] * 4)
    assert scores.score == [1.0, 2.0, 0.5, 3.0] and scores.error == [None] * 4


def test_sys_exit_in_a_reward_is_a_failure_not_an_exit():
    scores = score_all(lambda c, e: exit(3), ["a"], [{}], on_error="zero")
    assert scores.error == ["SystemExit(3) raised by the reward"]


def _raising(make_exception):
    def reward(completion, example):
        if completion == "oops":
            raise make_exception()
        return 1.0
    return reward


NOT_EXCEPTIONS = [  # BaseExceptions that are not Exceptions, and the reason recorded
    (KeyboardInterrupt, "KeyboardInterrupt raised by the reward"),
    (lambda: SystemExit(3), "SystemExit(3) raised by the reward"),
    (GeneratorExit, "GeneratorExit raised by the reward"),
]


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize(("make_exception", "reason"), NOT_EXCEPTIONS, ids=[r.split()[0] for _, r in NOT_EXCEPTIONS])
def test_keyboard_interrupt_or_system_exit_raised_by_a_reward_fails_its_sample_at_once(make_exception, reason,
                                                                                      workers, processes):
    # It used to end the worker thread, so the sample was "timed out after 120 s" after 120 s (and, with one worker,
    # every later sample waited for that too); a worker process died ("exit code 1") with a traceback.
    start = time.monotonic()
    scores = score_all(_raising(make_exception), COMPLETIONS * 2, EXAMPLES * 2, on_error="zero", timeout_s=120,
                       workers=workers, processes=processes)
    assert time.monotonic() - start < 60  # at once: well before the time limit, also on a busy machine
    assert scores.error == [None, None, None, reason] * 2 and scores.score == [1.0, 1.0, 1.0, 0.0] * 2
    start = time.monotonic()
    with pytest.raises(RewardError) as raised:
        score_all(_raising(make_exception), COMPLETIONS, EXAMPLES, timeout_s=120, workers=workers, processes=processes)
    assert time.monotonic() - start < 60
    assert str(raised.value) == f"reward failed on sample 3 (completion 'oops'): {reason}"


def test_threads_without_a_timeout_record_a_keyboard_interrupt_raised_by_a_reward():
    # It used to wait forever for the sample of the thread it ended.
    scores = score_all(_raising(KeyboardInterrupt), COMPLETIONS, EXAMPLES, on_error="zero", workers=4)
    assert scores.error == [None, None, None, "KeyboardInterrupt raised by the reward"]


def test_in_the_calling_thread_a_keyboard_interrupt_stops_scoring():
    """There it cannot be told from the user's Ctrl-C; GeneratorExit and SystemExit are failures as anywhere."""
    with pytest.raises(KeyboardInterrupt):
        score_all(_raising(KeyboardInterrupt), COMPLETIONS, EXAMPLES, on_error="zero")
    scores = score_all(_raising(GeneratorExit), COMPLETIONS, EXAMPLES, on_error="zero")
    assert scores.error == [None, None, None, "GeneratorExit raised by the reward"]


@pytest.fixture
def default_sigint_handler():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


CTRL_C_MODES = [dict(), dict(workers=1, timeout_s=30), dict(workers=4), dict(workers=1, processes=True),
                dict(workers=4, processes=True, timeout_s=30)]


@pytest.mark.parametrize("mode", CTRL_C_MODES, ids=["serial", "1-thread", "4-threads", "1-process", "4-processes"])
def test_the_users_ctrl_c_stops_scoring_at_once_and_the_workers_with_it(mode, default_sigint_handler, capfd):
    """Sample 3 presses Ctrl-C: SIGINT to the caller's process, and to the reward's process as a terminal does."""
    caller, called = os.getpid(), []

    def reward(completion, example):
        called.append(completion)
        if completion == "ctrl-c":
            if os.getpid() != caller:  # a worker process
                os.kill(os.getpid(), signal.SIGINT)
            os.kill(caller, signal.SIGINT)
        time.sleep(0.1)
        return 1.0

    before = set(threading.enumerate())
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        score_all(reward, ["a"] * 3 + ["ctrl-c"] + ["a"] * 3000, [{}] * 3004, **mode)  # 75 s or more to score them all
    assert time.monotonic() - start < 30
    calls_when_stopped = len(called)
    time.sleep(0.5)  # each worker thread finishes its sample (0.1 s) and takes no other
    assert len(called) == calls_when_stopped
    assert [t for t in threading.enumerate() if t not in before] == []
    assert [p for p in multiprocessing.active_children() if p.name == "reward-worker"] == []
    assert "Traceback" not in capfd.readouterr().err  # no worker process died of the Ctrl-C with a traceback


def _hangs_on_sample_2(completion, example):
    if completion == "hang":
        time.sleep(60)
    return 1.0


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_hanging_reward_times_out_and_the_others_still_score(processes):
    start = time.monotonic()
    scores = score_all(_hangs_on_sample_2, COMPLETIONS, EXAMPLES, on_error="zero", timeout_s=0.5, workers=2,
                       processes=processes)
    assert time.monotonic() - start < 30  # the 60 s hang was not waited for
    assert scores.score == [1.0, 1.0, 0.0, 1.0]
    assert scores.error == [None, None, "timed out after 0.5 s", None]
    with pytest.raises(RewardError, match=r"sample 2 \(completion 'hang'\): timed out after 0.5 s"):
        score_all(_hangs_on_sample_2, COMPLETIONS, EXAMPLES, timeout_s=0.5, workers=2, processes=processes)


def test_a_busy_loop_in_a_process_is_killed():
    def spin(completion, example):
        while completion == "hang":
            pass
        return 1.0

    scores = score_all(spin, COMPLETIONS, EXAMPLES, on_error="zero", timeout_s=0.5, workers=2, processes=True)
    assert scores.error[2] == "timed out after 0.5 s" and scores.score == [1.0, 1.0, 0.0, 1.0]


def test_a_worker_process_that_dies_is_recorded_and_replaced():
    def die(completion, example):
        if completion == "oops":
            os._exit(7)
        return 1.0

    scores = score_all(die, COMPLETIONS * 2, EXAMPLES * 2, on_error="zero", workers=2, processes=True)
    assert scores.error == [None] * 3 + ["the reward's worker process died (exit code 7)"] + [None] * 3 + [
        "the reward's worker process died (exit code 7)"]
    assert scores.score == [1.0, 1.0, 1.0, 0.0] * 2


def test_an_unpicklable_result_from_a_process_is_recorded():
    scores = score_all(lambda c, e: {"score": 1.0, "lock": threading.Lock()}, ["a"], [{}], on_error="zero",
                       processes=True)
    assert scores.error[0].startswith("the reward's result could not be sent back from its process: TypeError")


def test_threads_run_in_parallel():
    """Each of the 4 samples waits for the other 3 to be scored at once: one after the other, the first would fail."""
    together = threading.Barrier(4, timeout=30)

    def reward(completion, example):
        together.wait()
        return 1.0

    scores = score_all(reward, ["a"] * 4, [{}] * 4, workers=4, timeout_s=60)
    assert scores.score == [1.0] * 4


def test_serial_mode_runs_in_the_calling_thread():
    seen = score_all(lambda c, e: float(threading.current_thread() is threading.main_thread()), ["a"], [{}])
    assert seen.score == [1.0]


# --- batched rewards ---------------------------------------------------------------------------------------
def test_batched_reward_is_called_once():
    calls = []

    @batched
    def lengths(completions, examples):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    assert score_all(lengths, COMPLETIONS, EXAMPLES, workers=4, timeout_s=5).score == [2.0, 2.0, 4.0, 4.0]
    assert calls == [4]


def test_batched_reward_with_the_wrong_count_fails_every_sample():
    short = batched(lambda completions, examples: [1.0] * (len(completions) - 1))
    scores = score_all(short, COMPLETIONS, EXAMPLES, on_error="zero")
    assert scores.error == ["batched reward returned 3 scores for 4 samples"] * 4 and scores.score == [0.0] * 4
    with pytest.raises(RewardError, match=r"sample 0 .* returned 3 scores for 4 samples \(3 other samples"):
        score_all(short, COMPLETIONS, EXAMPLES)
    scalar = batched(lambda completions, examples: 1.0)
    assert score_all(scalar, ["a"], [{}], on_error="zero").error == [
        "a batched reward must return a list of 1 scores, got float"]


def test_batched_reward_can_fail_single_samples():
    partly = batched(lambda completions, examples: [1.0, ValueError("judge said nothing"), float("nan"), 0.5])
    scores = score_all(partly, COMPLETIONS, EXAMPLES, on_error="zero")
    assert scores.error == [None, "ValueError: judge said nothing", "reward 'score' is nan", None]
    assert scores.score == [1.0, 0.0, 0.0, 0.5]


def test_batched_reward_that_hangs_times_out():
    slow = batched(lambda completions, examples: time.sleep(60))
    scores = score_all(slow, COMPLETIONS, EXAMPLES, on_error="zero", timeout_s=0.3)
    assert scores.error == ["timed out after 0.3 s"] * 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_error"):
        score_all(exact, COMPLETIONS, EXAMPLES, on_error="ignore")
    with pytest.raises(ValueError, match="4 completions but 3 examples"):
        score_all(exact, COMPLETIONS, EXAMPLES[:3])
