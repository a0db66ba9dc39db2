"""What a task carries for the session (`Task.settings`: the settings it needs to learn, used unless given) and what
a run says when its settings cannot work (`metrics.alarms`: completions cut at the token limit, advantages all 0),
once per session."""

import warnings

import pytest

import rlbench as rl

SMALL = dict(prompts_per_step=2, samples_per_prompt=2, log_dir=None, threads=1)


def test_the_calculator_brings_its_turn_length_unless_it_is_given():
    # a call with its arguments takes about 55 tokens of tiny-tools: Config's 16 would cut every one
    with rl.Session(model="tiny-tools", task="calculator", **SMALL) as own:
        assert own.config.max_new_tokens == 64 and own.task_settings == {"max_new_tokens": 64}
        assert "max_new_tokens=64 (the task's)" in repr(own)
    with rl.Session(model="tiny-tools", task="calculator", max_new_tokens=32, **SMALL) as given:
        assert given.config.max_new_tokens == 32 and given.task_settings == {} and "the task's" not in repr(given)
    # a Config's field counts as given where it differs from the field's default
    config = rl.Config(model="tiny-tools", task="calculator", max_new_tokens=48, **SMALL)
    with rl.Session(config) as from_config:
        assert from_config.config.max_new_tokens == 48
    with rl.Session(rl.Config(model="tiny-tools", task="calculator", **SMALL)) as defaults:
        assert defaults.config.max_new_tokens == 64
    assert rl.tasks.settings_of(rl.tasks.get("arithmetic")) == {}  # a task without settings needs none


def test_a_task_of_your_own_brings_its_settings_and_unknown_ones_are_named():
    task = rl.tasks.get("calculator")
    mine = rl.tasks.AgentTask(task.train, task.test, env=rl.tasks.Calculator, parser=task.parser, name="mine",
                              settings={"max_new_tokens": 80, "lr": 3e-4})
    with rl.Session(model="tiny-tools", task=mine, lr=1e-4, **SMALL) as session:
        assert (session.config.max_new_tokens, session.config.lr) == (80, 1e-4)
        assert session.task_settings == {"max_new_tokens": 80}
    odd = rl.tasks.AgentTask(task.train, task.test, env=rl.tasks.Calculator, name="odd", settings={"max_tokens": 80})
    with pytest.raises(ValueError, match=r"task 'odd' asks for unknown Session setting\(s\) \['max_tokens'\]"):
        rl.Session(model="tiny-tools", task=odd, **SMALL)


def test_completions_cut_at_the_limit_are_warned_of_once_naming_the_setting():
    with rl.Session(model="tiny-arith", task="arithmetic", max_new_tokens=1, **SMALL) as session:
        with pytest.warns(UserWarning, match=r"step 0: 100% of the completions were cut at max_new_tokens=1, "
                                             r"before EOS.*Raise max_new_tokens"):
            session.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per session
            session.step()
    with rl.Session(model="tiny-arith", task="arithmetic", max_new_tokens=8, **SMALL) as enough:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*max_new_tokens")
            enough.step()


def test_tool_calls_cut_at_the_turn_limit_are_warned_of():
    # at 16 tokens per turn every call of tiny-tools is cut (the greedy episodes that call, 155 of 200, all end so;
    # accuracy 0.005: the same on the machine's own arithmetic, ATEN_CPU_CAPABILITY=avx2, and =default with
    # MKL_CBWR=COMPATIBLE)
    with rl.Session(model="tiny-tools", task="calculator", max_new_tokens=16, **SMALL) as session:
        with pytest.warns(UserWarning, match=r"evaluate \(greedy\): [1-9]\d* of 200 episodes ended on a turn cut at "
                                             r"max_new_tokens=16 \(per turn\), against 0 tool calls that gave a result"):
            assert session.evaluate()["greedy_accuracy"] < 0.05  # only direct answers can score (measured 0.005)


class Constant(rl.tasks.Arithmetic):
    """Arithmetic whose reward is 1 whatever the completion: every group's samples score alike."""

    def reward(self, completion, example):
        return 1.0


def test_a_step_whose_every_advantage_is_0_is_warned_of():
    with rl.Session(model="tiny-arith", task=Constant(), max_new_tokens=8, **SMALL) as session:
        with pytest.warns(UserWarning, match=r"step 0: every advantage is 0 \(each group's samples scored alike\)"):
            row = session.step()
    assert row["advantage_abs_mean"] == 0.0


@pytest.mark.slow
def test_the_calculator_learns_with_the_settings_a_user_types():
    # nothing but the model, the task and the algorithm: the task brings its turn length. Measured with the default
    # settings (16 prompts x 8 episodes, lr 1e-4): 0.2 -> 0.575 in 20 steps, tool success 0.91, on the machine's own
    # arithmetic, ATEN_CPU_CAPABILITY=avx2, and =default with MKL_CBWR=COMPATIBLE alike
    with rl.Session(model="tiny-tools", task="calculator", algorithm="grpo", log_dir=None) as session:
        before = session.evaluate()["greedy_accuracy"]
        metrics = session.run(20, progress=False)
        after = session.evaluate()["greedy_accuracy"]
    assert 0.15 <= before <= 0.35 and after >= before + 0.15, (before, after)  # tiny-tools' band, then learning
    assert metrics["tool_success_rate"].mean() > 0.8 and metrics["ended_max_tokens"].fillna(0).max() < 0.1
