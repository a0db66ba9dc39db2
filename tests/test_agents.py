"""Agentic episodes on a scripted sampler (environments, parsing, masks, rewards without a model) and on the real
ones (the trainer's log-probs of sampled tokens equal the sampler's across turns; non-sampled tokens get no
gradient)."""

import dataclasses
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from floats import approx, assert_close

import rlbench as rl
from agent_games import Sums, call, sums_model, sums_task
from rlbench.agents import HermesParser, check_template, tools_of
from rlbench.samplers import SamplingParams, ScriptedSampler

DRIFTING = ("{% for m in messages %}{% set c = m.content %}"
            "{% if m.role == 'assistant' and not loop.last and '</think>' in c %}{% set c = c.split('</think>')[1] %}"
            "{% endif %}<|{{ m.role }}|>{{ c }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Drops the reasoning of earlier assistant turns (as Qwen3's template does): not append-only."""


@pytest.fixture(scope="module")
def tokenizer(chat_dir):
    return rl.models.load_tokenizer(chat_dir)


class Calc(rl.Env):
    """One instance per episode: the example's answer, a calculator tool, reward 1 for the right final answer."""

    def reset(self, prompt, answer):
        self.answer = answer
        return prompt

    @rl.tool
    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3*4".
        """
        a, b = expression.split("*")
        return str(int(a) * int(b))

    @rl.tool
    def fail(self, x: int) -> str:
        """Always raises."""
        raise ZeroDivisionError("even operand")

    @rl.tool
    def hang(self) -> str:
        """Never returns in time."""
        time.sleep(3600)  # far past any time limit here: a test that waited for it would never end
        return "late"

    def reward(self, episode) -> float:
        return float(episode.final_text.strip() == self.answer)


EXAMPLES = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in (12, 23, 34) for b in (45, 56)]


def scripted(tokenizer, turns: dict[int, str]):
    """A sampler whose turn k (counted from the tool results in the context) is `turns[k]` (then EOS), or
    the last tool result as the final answer."""
    def respond(context: str):
        k = context.count("<|tool|>")
        if k in turns:
            text = turns[k](context) if callable(turns[k]) else turns[k]
        else:
            text = context.rsplit("<|tool|>", 1)[1].split("\n")[0]
        return text
    return ScriptedSampler(tokenizer, respond, eos=True)


def test_a_scripted_answer_ends_with_eos_without_the_script_knowing_its_id(tokenizer):
    """`eos=True`: a completion with no stop token gets EOS; one with a stop token is cut there, as sampled."""
    stop = tokenizer.encode("7", add_special_tokens=False)[0]
    sampler = ScriptedSampler(tokenizer, lambda context: context[-2:], eos=True)
    batch = sampler.generate([tokenizer.encode("a12", add_special_tokens=False), tokenizer.encode("b78", add_special_tokens=False)],
                             SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))
    twelve = tokenizer.encode("12", add_special_tokens=False)
    assert batch["response_ids"][0].tolist() == twelve + [tokenizer.eos_token_id]
    assert batch["response_ids"][1, :1].tolist() == [stop] and batch["response_mask"][1].sum() == 1  # no EOS added
    assert batch["finished"].tolist() == [True, True]


def session(chat_dir, tokenizer, turns, *, env=Calc, max_turns=3, tool_timeout_s=0.5, **overrides):
    task = rl.tasks.AgentTask(EXAMPLES, EXAMPLES[:2], env=env, max_turns=max_turns, tool_timeout_s=tool_timeout_s)
    settings = dict(model=chat_dir, task=task, sampler=scripted(tokenizer, turns), cluster="inline",
                    prompts_per_step=2, samples_per_prompt=2, max_new_tokens=120) | overrides
    return rl.Session(**settings)


def question(context: str) -> str:
    return context.split("<|user|>")[1].split("=")[0]


# ------------------------------------------------------------------------------------------------ tools
def test_tool_schema_from_signature_and_docstring():
    @rl.tool
    def lookup(key: str, limit: int = 3) -> str:
        """Find a key in the table.

        Args:
            key: what to look for, exactly
                as stored.
            limit: most results.
        """
        return key

    assert lookup.schema == {"type": "function", "function": {
        "name": "lookup", "description": "Find a key in the table.",
        "parameters": {"type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "description": "what to look for, exactly as stored."},
            "limit": {"type": "integer", "description": "most results."}}}}}
    assert lookup.check({"key": "a"}) == {"key": "a"}
    with pytest.raises(ValueError, match="lookup has no argument.* k; it takes: key, limit"):
        lookup.check({"k": "a"})
    with pytest.raises(ValueError, match="missing argument.* key"):
        lookup.check({})
    with pytest.raises(ValueError, match="argument limit of lookup must be integer, got str"):
        lookup.check({"key": "a", "limit": "3"})
    with pytest.raises(ValueError, match="needs a docstring"):
        rl.tool(lambda x: x)


def test_environment_tools_are_its_marked_methods_bound_to_the_instance():
    class Helped(Calc):
        def helper(self) -> str:
            """Documented, not marked: not a tool."""
            return "help"

        def hang(self) -> str:
            """Overrides a marked method: still a tool."""
            return "now"

    env = Helped()
    env.reset("1*2=", "2")
    tools = tools_of(env)
    assert sorted(tools) == ["calc", "fail", "hang"]
    assert tools["calc"](expression="3*4") == "12" and tools["calc"].fn.__self__ is env
    assert tools["hang"]() == "now" and tools["hang"].description == "Overrides a marked method: still a tool."
    assert tools_of(Helped)["calc"].schema == tools["calc"].schema  # the class gives the schemas without an instance


def test_the_environment_contract_is_checked_when_the_task_is_made():
    def make(env, **kw):
        return rl.tasks.AgentTask(EXAMPLES, env=env, **kw)

    class Plain:  # duck-typed: its kind would be a guess
        def reset(self, prompt):
            return prompt

        def step(self, action):
            return "", 0.0, True

    with pytest.raises(ValueError, match=r"env=Plain is not an environment class: subclass rl.Env .* or rl.Game"):
        make(Plain)

    class Unmarked(rl.Env):
        def calc(self, expression: str) -> str:
            """Documented, not marked."""

        def reward(self, episode):
            return 0.0

    with pytest.raises(ValueError, match=r"Unmarked has no tools \(calc is not marked\): mark a tool method"):
        make(Unmarked)
    make(Unmarked, tools=[lambda_tool])  # function tools are enough

    class NoReward(rl.Env):
        @rl.tool
        def calc(self, expression: str) -> str:
            """Evaluate."""

    with pytest.raises(ValueError, match=r"NoReward defines no reward\(episode\): define it, or give the task reward="):
        make(NoReward)
    make(NoReward, reward=lambda episode, example: 0.0)

    class Documented(Sums):  # a game with a documented helper is still a game
        def hint(self) -> str:
            """A documented helper."""
            return "add"

    assert rl.agents.EnvPool(Documented).game

    class ToolGame(Sums):
        @rl.tool
        def peek(self) -> str:
            """Tools are for an rl.Env."""

    with pytest.raises(ValueError, match=r"ToolGame is an rl.Game .* it has peek: make it an rl.Env"):
        make(ToolGame)
    with pytest.raises(ValueError, match=r"Sums is an rl.Game .* it has lambda_tool"):
        make(Sums, tools=[lambda_tool])


@rl.tool
def lambda_tool(x: int) -> str:
    """A function tool."""
    return str(x)


# ----------------------------------------------------------------------------------------------- parser
def test_hermes_parser_reads_calls_and_explains_bad_ones():
    parser = HermesParser()
    calls, errors = parser.parse("thinking " + call("calc", expression="1*2") + call("calc", expression="3*4"))
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "1*2"}), ("calc", {"expression": "3*4"})]
    assert errors == []
    calls, errors = parser.parse('<tool_call>{"name": "calc", "arguments": {"expression": }</tool_call>')
    assert calls == [] and errors[0].startswith("malformed tool call JSON (Expecting value")
    _, errors = parser.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert errors[0].startswith('a tool call is {"name": <string>, "arguments": <object>}')
    _, errors = parser.parse('<tool_call>{"name": "calc"')
    assert errors[0].startswith("unterminated tool call")
    calls, _ = parser.parse('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*2\\"}"}</tool_call>')
    assert calls[0].arguments == {"expression": "2*2"}


# ------------------------------------------------------------------------------------------- templates
def test_check_template_passes_an_append_only_template(tokenizer):
    messages = [{"role": "user", "content": "12*45="}, {"role": "assistant", "content": call("calc", expression="12*45")},
                {"role": "tool", "content": "540"}, {"role": "assistant", "content": "540"}]
    report = check_template(tokenizer, messages)
    assert report.ok and len(report.turns) == 2, report
    # the attack: a list of strings raised "TypeError: string indices must be integers" from inside
    with pytest.raises(ValueError, match=r"check_template: message 0 'hello': expected a dict with a string role and "
                                         r"content"):
        check_template(tokenizer, ["hello"])


def test_check_template_reports_the_first_differing_token_of_a_drifting_template(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = DRIFTING
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>" + call("f")},
                {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]
    report = check_template(tokenizer, messages)
    assert not report.ok
    # once a tool message follows turn 0, the whole render drops its "<think>hm</think>": both turns first differ
    # after the prompt's "<|assistant|>" and the "<t" that "<think>" and "<tool_call>" share (a token per character)
    position = len(tokenizer.encode("<|user|>q\n<|assistant|><t"))
    for turn in report.turns:
        assert turn["position"] == position and turn["appended"].startswith("hink>")
        assert turn["whole"].startswith("ool_call")
    assert f"turn 1: first difference at token {position}: appended 'hink>" in str(report)


def test_session_warns_at_start_up_when_the_template_drifts(chat_dir, tmp_path):
    drift = tmp_path / "drift"
    shutil.copytree(chat_dir, drift)
    tokenizer = rl.models.load_tokenizer(drift)
    tokenizer.chat_template = DRIFTING.replace("'</think>' in c", "true")  # drops every earlier answer
    tokenizer.save_pretrained(drift)
    with pytest.warns(UserWarning, match="NOT append-only"):
        session(str(drift), tokenizer, {}).close()


# ------------------------------------------------------------------------------------------- episodes
def test_an_episode_keeps_the_sampled_tokens_and_marks_what_made_each(chat_dir, tokenizer):
    s = session(chat_dir, tokenizer, {0: lambda c: call("calc", expression=question(c))})
    ep = s.episode(EXAMPLES[0])
    assert isinstance(ep, rl.agents.EpisodeHandle) and isinstance(ep.record, rl.agents.Episode)
    ep.step()
    assert [(c.name, c.arguments) for c in ep.pending_tool_calls] == [("calc", {"expression": "12*45"})]
    assert ep.turns[0].stop_reason == "tool_call" and not ep.done
    ep.step()  # the tool runs, its result and the next generation prompt are appended
    assert tokenizer.decode(ep.ids) == call("calc", expression="12*45") + "<eos>\n<|tool|>540\n<|assistant|>"
    ep.step()
    assert ep.done and ep.stop_reason == "eos" and ep.final_text == "540" and ep.reward() == 1.0
    table = ep.to_pandas()
    sampled = table[table.trainable]
    # every sampled token is the sampler's, with its log-prob (token i of a scripted turn: -(i+1)/100)
    turn0 = tokenizer.encode(call("calc", expression="12*45")) + [tokenizer.eos_token_id]
    assert sampled[sampled.turn == 0].token_id.tolist() == turn0
    assert sampled[sampled.turn == 0].sampler_logp.tolist() == approx([-(i + 1) / 100 for i in range(len(turn0))])
    assert "".join(table[table.kind == "tool"].text) == "540"
    assert "".join(table[table.kind == "template"].text) == "\n<|tool|>\n<|assistant|>"
    appended = len(tokenizer.encode("\n<|tool|>540\n<|assistant|>"))
    assert table.turn.tolist() == [0] * (len(turn0) + appended) + [1] * 4
    # one row per stretch of one turn and kind, with the sampled stretches' log-probs summed
    stretches = ep.stretches()
    assert list(zip(stretches.turn, stretches.kind, stretches.text)) == [
        (0, "sampled", call("calc", expression="12*45") + "<eos>"), (0, "template", "\n<|tool|>"), (0, "tool", "540"),
        (0, "template", "\n<|assistant|>"), (1, "sampled", "540<eos>")]
    assert stretches.tokens.sum() == len(table) and stretches.position.iloc[0] == table.position.iloc[0]
    assert stretches.sampler_logp.iloc[0] == approx(-sum(i + 1 for i in range(len(turn0))) / 100)
    assert stretches.logp_per_token.iloc[0] == approx(stretches.sampler_logp.iloc[0] / len(turn0))
    assert stretches.sampler_logp.iloc[1:4].isna().all() and stretches.trainable.tolist() == [True, False, False,
                                                                                               False, True]
    assert "sampled" in ep._repr_html_() and "tool_call" in ep._repr_html_()
    s.close()


def test_a_tool_result_can_be_edited_before_it_is_appended(chat_dir, tokenizer):
    s = session(chat_dir, tokenizer, {0: call("calc", expression="2*3")})
    ep = s.episode(EXAMPLES[0])
    ep.step()
    ep.pending_tool_calls[0].arguments["expression"] = "12*45"  # edit the call
    assert ep.run_tools() == ["540"]
    ep.pending_tool_results[0] = "541"  # and the result
    ep.step()
    ep.step()
    assert ep.final_text == "541" and ep.reward() == 0.0
    s.close()


def test_rollout_batch_rows_and_masks(chat_dir, tokenizer):
    s = session(chat_dir, tokenizer, {0: lambda c: call("calc", expression=question(c))})
    batch = s.rollout()
    assert len(batch) == 4 and batch["group_ids"].tolist() == [0, 0, 1, 1]
    kinds = batch["token_kind"]
    assert torch.equal(batch["loss_mask"], (kinds == 1).long())
    assert torch.equal(batch["response_mask"], (kinds >= 0).long())
    assert (batch["sampler_logp"][batch["loss_mask"] == 0] == 0).all()
    assert (batch["sampler_logp"][batch["loss_mask"] == 1] < 0).all()
    assert batch["turns"].tolist() == [2] * 4 and batch["tool_calls"].tolist() == [1] * 4
    assert batch["stop_reason"] == ["eos"] * 4 and batch["version"].max() == 0
    record = batch["episode"][0]  # a record: plain data that pickles, with nothing to step
    again = pickle.loads(pickle.dumps(record))
    assert type(again) is rl.agents.Episode and again.ids == record.ids and again.score == record.score == 1.0
    assert not hasattr(record, "step")
    scored = s.advantage(s.score(batch))
    assert scored["score"].tolist() == [1.0] * 4
    row = s.step()
    assert row["turns_mean"] == 2 and row["tool_success_rate"] == 1.0 and row["ended_eos"] == 1.0
    s.close()


@pytest.mark.parametrize("turn0, reason", [
    ('<tool_call>{"name": "calc", "arguments": {"expression": }</tool_call>', "malformed tool call JSON"),
    (call("nope", x=1), "unknown tool 'nope'; tools: calc, fail, hang"),
    (call("calc", expr="1*2"), "calc has no argument(s) expr"),
    (call("fail", x=1), "tool fail raised ZeroDivisionError: even operand"),
    (call("hang"), "tool hang timed out after "),  # then the seconds it waited (0.5 or more)
])
def test_a_bad_call_becomes_a_tool_message_and_a_count(chat_dir, tokenizer, turn0, reason):
    s = session(chat_dir, tokenizer, {0: turn0, 1: "done"})
    batch = s.rollout()
    assert batch["tool_errors"].tolist() == [1] * 4 and batch["tool_calls"].tolist() == [1] * 4
    episode = batch["episode"][0]
    assert episode.turns[0].errors[0].startswith(reason)
    assert episode.turns[0].results == ["error: " + episode.turns[0].errors[0]]
    assert f"<|tool|>error: {reason}" in batch["completion"][0] and batch["stop_reason"][0] == "eos"
    s.close()


def test_max_turns_context_overflow_and_a_failing_reset_are_recorded(chat_dir, tokenizer):
    closed = []

    class Closing(Calc):
        def close(self):
            closed.append(self.answer)

    s = session(chat_dir, tokenizer, {k: call("calc", expression="2*2") for k in range(9)}, max_turns=2, env=Closing)
    closed.clear()  # the start-up template check's environment
    batch = s.rollout()
    assert batch["stop_reason"] == ["max_turns"] * 4 and batch["turns"].tolist() == [2] * 4
    pool = next(g for g in s.workers.groups if g.name == "envs").hosts[0].objects["envs"]
    assert len(closed) == 4 and pool.envs == {}  # no environment outlives its episode
    s.close()

    s = session(chat_dir, tokenizer, {k: call("calc", expression="2*2") for k in range(99)}, max_turns=99)
    batch = s.rollout()  # 512 positions fill up after a few turns
    assert batch["stop_reason"] == ["context_full"] * 4
    assert int((batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).max()) <= 512
    s.close()

    class Broken(Calc):
        def reset(self, prompt, answer):
            if answer == "540":
                raise KeyError("no such level")
            return super().reset(prompt, answer)

    s = session(chat_dir, tokenizer, {0: lambda c: call("calc", expression=question(c))}, env=Broken,
                prompts_per_step=len(EXAMPLES))
    batch = s.score(s.rollout())
    broken = torch.tensor([e["answer"] == "540" for e in batch["example"]])
    assert broken.sum() == 2 and batch["stop_reason"] == ["error" if b else "eos" for b in broken]
    assert {batch["reward_error"][i] for i in broken.nonzero().flatten()} == {"reset raised KeyError: 'no such level'"}
    assert batch["loss_mask"][broken].sum() == 0 and batch["score"].tolist() == (~broken).float().tolist()
    s.step()  # a partial batch trains
    s.close()


def test_episodes_overlap_with_the_update(chat_dir, tokenizer):
    s = session(chat_dir, tokenizer, {0: lambda c: call("calc", expression=question(c))}, overlap_rollout=True)
    metrics = s.run(steps=3, progress=False)
    assert metrics["turns_mean"].tolist() == [2.0] * 3 and metrics["reward_mean"].tolist() == [1.0] * 3
    s.close()


def test_a_reward_that_raises_is_recorded(chat_dir, tokenizer):
    class BadReward(Calc):
        def reward(self, episode):
            return {"acc": float("nan")}

    s = session(chat_dir, tokenizer, {0: "12"}, env=BadReward)
    batch = s.score(s.rollout())
    assert batch["reward_error"][0] == "reward raised ValueError: reward 'acc' is nan"
    assert batch["score"].tolist() == [0.0] * 4
    s.close()


class HangingReset(Calc):
    def reset(self, prompt, answer):
        time.sleep(3600)  # past the test's 0.5 s limit (also in Session(), whose template check starts an episode)
        return prompt


class RolelessReset(Calc):
    def reset(self, prompt, answer):
        return [{"content": prompt}]


class HangingReward(Calc):
    def reward(self, episode):
        time.sleep(3600)
        return 1.0


class TenTurnRewards(Calc):
    def reward(self, episode):
        return [1.0] * 10


AT_LEAST_HALF_A_SECOND = r"(0\.[5-9]|[1-9])[\d.]*"
"""The seconds a timed-out call waited, as its message says them: the 0.5 s limit, or more on a busy machine."""


@pytest.mark.parametrize("env, reason", [
    (HangingReset, rf"reset timed out after {AT_LEAST_HALF_A_SECOND} s"),
    (RolelessReset, r"reset returned message 0 \{'content': '\d+\*\d+='\}: expected a dict with a string role and "
                    r"content"),
    (HangingReward, rf"reward timed out after {AT_LEAST_HALF_A_SECOND} s"),
    (TenTurnRewards, r"reward raised ValueError: reward gave 10 per-turn rewards for an episode of 1 turns"),
], ids=["reset-hangs", "reset-roleless", "reward-hangs", "reward-turns"])
def test_an_environment_that_hangs_or_returns_the_wrong_thing_ends_its_episode_with_the_reason(
        chat_dir, tokenizer, env, reason):
    # the attacks: each of these hung the session for ever, crashed the renderer or scored 10 for a 1-turn episode
    start = time.monotonic()
    s = session(chat_dir, tokenizer, {0: "540"}, env=env)
    batch = s.score(s.rollout())
    assert all(re.fullmatch(reason, error) for error in batch["reward_error"]), batch["reward_error"]
    assert batch["score"].tolist() == [0.0] * 4
    row = s.step()  # and the step records them, not an exception
    assert row["reward_mean"] == 0.0 and time.monotonic() - start < 300  # none waited for a 3600 s hang
    s.close()


@pytest.mark.parametrize("returned, reason", [
    (("done",), r"step returned \('done',\): expected \(observation, reward, done\) \(.*values to unpack.*\)"),
    (("", "1", True), r"step returned \('', '1', True\): expected \(observation, reward, done\) \(reward 'step' "
                      r"must be a number, got str '1'\)"),
    (("", float("inf"), True), r"step returned \('', inf, True\): expected .* \(reward 'step' is inf\)"),
])
def test_a_game_step_that_returns_the_wrong_shape_ends_its_episode_instead_of_waiting_for_ever(
        chat_dir, tokenizer, returned, reason):
    class Wrong(rl.Game):
        def reset(self, **_):
            return "guess the number"

        def step(self, action: str):
            return returned

    s = rl.Session(model=chat_dir, task=rl.tasks.AgentTask(EXAMPLES, env=Wrong, max_turns=4), cluster="inline",
                   sampler=ScriptedSampler(tokenizer, lambda c: tokenizer.encode("1") + [tokenizer.eos_token_id]),
                   prompts_per_step=1, samples_per_prompt=2, max_new_tokens=8, log_dir=None)
    batch = s.score(s.rollout())  # was: the episode's thread died before posting a result, the rollout waited for ever
    assert batch["stop_reason"] == ["error"] * 2 and batch["turns"].tolist() == [1, 1]
    assert batch["score"].tolist() == [0.0, 0.0] and not batch["finished"].any()
    assert all(re.fullmatch(reason, e) for e in batch["reward_error"]), batch["reward_error"]
    s.close()


def test_a_step_in_which_no_episode_starts_is_recorded_with_the_reasons(chat_dir, tokenizer):
    class Broken(Calc):
        def reset(self, prompt, answer):
            raise RuntimeError("the level file is missing")

    s = session(chat_dir, tokenizer, {0: "540"}, env=Broken)
    batch = s.score(s.rollout())
    assert batch["reward_error"] == ["reset raised RuntimeError: the level file is missing"] * 4
    assert batch["response_mask"].shape == (4, 1) and batch["response_mask"].sum() == 0  # one padding column
    row = s.step()  # was: IndexError from amax() over an empty response
    assert row["reward_mean"] == 0.0
    s.close()


def test_a_first_observation_longer_than_the_context_is_recorded_and_never_run_through_the_model(chat_dir, tokenizer):
    class Verbose(Calc):
        def reset(self, prompt, answer):
            super().reset(prompt, answer)
            return "Read this first. " * 1200 + prompt  # 20,000 characters for a 512-position model

    s = session(chat_dir, tokenizer, {0: "540"}, env=Verbose)
    batch = s.score(s.rollout())
    assert batch["stop_reason"] == ["context_full"] * 4
    assert all(len(ep.prompt_ids) > 512 for ep in batch["episode"])  # the record keeps what the environment said
    assert batch["prompt_ids"].shape[1] == 1  # was: the whole 20,000-token prompt went through the policy's forward
    row = s.step()
    assert row["reward_mean"] == 0.0
    s.close()


def test_a_slow_tool_does_not_hold_up_the_other_episodes(chat_dir, tokenizer):
    """The first question's tool returns only once the 8 other episodes have ended: held up by it, they would not end
    (the tool gives up after 60 s) and the slow ones would end first."""
    ended, others_ended, held_up = [], threading.Event(), []
    slow = ("540", "672")  # 12*45 and 12*56, two samples each

    class Slow(Calc):
        def calc(self, expression: str) -> str:
            """Evaluate (for the first question, once the other episodes have ended)."""
            if expression.startswith("12") and not others_ended.wait(60):
                held_up.append(expression)
            return super().calc(expression)

        def reward(self, episode):
            ended.append(self.answer)
            if sum(answer not in slow for answer in ended) == 8:
                others_ended.set()
            return super().reward(episode)

    s = session(chat_dir, tokenizer, {0: lambda c: call("calc", expression=question(c))}, env=Slow,
                prompts_per_step=len(EXAMPLES), tool_timeout_s=120)
    batch = s.rollout()
    assert batch["score"].tolist() == [1.0] * len(batch) and not held_up, held_up
    assert len(ended) == 12 and not set(ended[:8]) & set(slow) and set(ended[8:]) == set(slow), ended
    s.close()


def test_game_environments_take_each_turn_as_an_action_with_per_turn_rewards(chat_dir, tokenizer):
    class Guess(rl.Game):
        def reset(self, **_):
            self.answer, self.tries = "540", 0
            return "guess the number"

        def step(self, action: str):
            self.tries += 1
            right = action.strip() == self.answer
            return ("higher" if not right else ""), float(right), right or self.tries >= 3

    s = rl.Session(model=chat_dir, task=rl.tasks.AgentTask(EXAMPLES, env=Guess, max_turns=4), cluster="inline",
                   sampler=ScriptedSampler(tokenizer, lambda c: tokenizer.encode(
                       "540" if c.count("higher") == 2 else "1") + [tokenizer.eos_token_id]),
                   prompts_per_step=1, samples_per_prompt=2, max_new_tokens=8)
    batch = s.rollout()
    assert batch["stop_reason"] == ["env_done"] * 2 and batch["turns"].tolist() == [3, 3]
    assert batch["turn_rewards"].tolist() == [[0.0, 0.0, 1.0]] * 2 and batch["score"].tolist() == [1.0, 1.0]
    assert batch["completion"][0] == "1<eos>\n<|user|>higher\n<|assistant|>1<eos>\n<|user|>higher\n<|assistant|>540<eos>"
    s.close()


# --------------------------------------------------------------------------------- real sampler, trainer
@pytest.fixture(scope="module")
def sums_session(tiny_dir, tmp_path_factory):
    """tiny-arith playing three sums in one context (`agent_games.Sums`), sampled by the HF sampler."""
    s = rl.Session(model=sums_model(tiny_dir, tmp_path_factory.mktemp("sums")), task=sums_task(), sampler="hf",
                   cluster="inline", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=6, seed=1)
    yield s
    s.close()


def test_trainer_log_probs_of_sampled_tokens_equal_the_samplers_across_three_turns(sums_session):
    batch = sums_session.rollout()
    three = batch["turns"] == 3
    assert three.sum() >= 4, batch["stop_reason"]  # tiny-arith ends its answers with EOS: three turns
    loss_mask = batch["loss_mask"].bool()
    assert (batch["turn"][loss_mask & three[:, None]].max()) == 2
    logp = sums_session.policy.log_probs(batch)
    assert_close(logp[loss_mask], batch["sampler_logp"][loss_mask], atol=1e-5)  # 1e-5: a decode loop vs a forward


def test_non_sampled_tokens_get_no_gradient(sums_session):
    from rlbench.policy.forward import response_logits

    batch = sums_session.advantage(sums_session.score(sums_session.rollout()))
    batch = batch.with_columns(advantages=torch.ones_like(batch["advantages"]) * batch["response_mask"])
    model = next(g for g in sums_session.workers.groups if g.name == "policy").hosts[0].objects["policy"].model
    logits = response_logits(model, batch.trimmed())
    logits.retain_grad()
    logp = rl.algorithms.token_logp(logits, batch.trimmed()["response_ids"])
    trimmed = batch.trimmed()
    loss, _ = sums_session.algorithm.actor_loss(logp, logp.detach(), trimmed["advantages"], trimmed["loss_mask"].float(),
                                               ref_logp_B_T=logp.detach(),
                                               num_tokens=int(trimmed["loss_mask"].sum()), num_seqs=len(trimmed),
                                               norm_length=6)
    loss.backward()
    grad_norm_B_T = logits.grad.norm(dim=-1)
    sampled = trimmed["loss_mask"].bool()
    assert (grad_norm_B_T[~sampled] == 0).all()
    assert (grad_norm_B_T[sampled] > 0).any()
    model.zero_grad(set_to_none=True)


def clear(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()


@pytest.mark.slow
def test_on_ray_environments_run_off_the_driver_and_a_slow_step_holds_up_only_its_episode(tiny_dir, tmp_path):
    """The first episode to act holds its first step until every other episode (of another first number) has ended:
    held up by it, they would not end (it gives up after 120 s) and it would not end last. The environment actor
    shares no memory with this process: the episodes say they started and ended by files in `folder`."""
    folder = tmp_path / "episodes"
    folder.mkdir()

    class Held(Sums):
        first = {}  # "a": the first number of the first episode to act (setdefault: one answer for every thread)
        gave_up = 0.0
        t0 = time.time()  # travels with the class to the environment actor: times since it fit the batch's float32

        def reset(self, a, b, **_):
            self.mark = f"{a}-{uuid.uuid4().hex}"
            (folder / f"started-{self.mark}").touch()
            return super().reset(a, b)

        def step(self, action: str):
            if self.a == Held.first.setdefault("a", self.a) and self.i == 0:
                deadline = time.time() + 120
                while not self.others_ended():
                    if time.time() > deadline:
                        self.gave_up = 1.0
                        break
                    time.sleep(0.05)
            return super().step(action)

        def others_ended(self) -> bool:
            started = [p.name.removeprefix("started-") for p in folder.glob("started-*")]
            others = [mark for mark in started if mark.split("-")[0] != str(Held.first["a"])]
            return len(started) == 8 and all((folder / f"ended-{mark}").exists() for mark in others)

        def reward(self, episode):
            import os

            ended = time.time() - self.t0  # before the file: the held episode, which waits for it, ends later
            (folder / f"ended-{self.mark}").touch()
            return {"right": sum(t.reward or 0.0 for t in episode.turns), "ended": ended, "pid": os.getpid(),
                    "held": float(self.a == Held.first["a"]), "gave_up": self.gave_up}

    import agent_games
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(agent_games)  # the actor cannot import the tests' modules
    task = dataclasses.replace(sums_task(Held), tool_timeout_s=300)  # the held step's limit: far past its wait
    s = rl.Session(model=sums_model(tiny_dir, tmp_path), task=task, sampler="hf", cluster="ray",
                   prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, seed=1)
    try:
        clear(folder)  # the start-up template check's episode
        batch = s.rollout()
        assert os.getpid() not in batch["pid"].tolist()  # scored in the environment actor
        held = batch["held"].bool()
        assert not batch["gave_up"].any(), "the other episodes waited for the held one"
        assert 1 <= int(held.sum()) <= 4 and batch["ended"][~held].max() < batch["ended"][held].min(), batch["ended"]
        clear(folder)  # the step's rollout: 8 episodes of its own
        s.step()
    finally:
        s.close()
        cloudpickle.unregister_pickle_by_value(agent_games)


@pytest.mark.parametrize("preset", [n for n in rl.algorithms.names() if rl.algorithms.get(n).needs_turns])
def test_turn_credit_presets_train_on_episodes_with_per_turn_rewards(tiny_dir, tmp_path, preset):
    s = rl.Session(model=sums_model(tiny_dir, tmp_path), task=sums_task(), algorithm=preset, sampler="hf",
                   cluster="inline", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=6, seed=1)
    batch = s.advantage(s.score(s.rollout()))
    assert batch["turn_rewards"].abs().sum() > 0  # the game rewards each right sum
    sampled = batch["loss_mask"].bool()
    assert (batch["advantages"][~sampled] == 0).all() and batch["advantages"][sampled].abs().sum() > 0
    metrics = s.run(steps=3, progress=False)
    assert metrics["grad_norm"].gt(0).all() and metrics["skipped"].eq(0).all()
    s.close()


def test_an_agentic_run_restored_from_a_checkpoint_goes_on_bit_for_bit_with_an_evaluation_in_between(tiny_dir,
                                                                                                     tmp_path):
    # the attack: an episode's seed hashed a per-process count of the episodes started, so an evaluate() or an
    # s.episode() changed later training rollouts, and a restored run (a new count) did not go on as the whole one
    settings = dict(model=sums_model(tiny_dir, tmp_path), task=sums_task(), sampler="hf", cluster="inline", threads=1,
                    prompts_per_step=4, samples_per_prompt=4, max_new_tokens=6, seed=1, log_dir=None)
    with rl.Session(**settings) as s:
        whole = s.run(4, progress=False)
    with rl.Session(**settings, save_dir=str(tmp_path / "checkpoints")) as s:
        s.run(2, progress=False)
        s.evaluate(max_prompts=2)
        s.episode().step()
        path = s.save()
    with rl.Session.restore(path, task=sums_task()) as s:
        rest = s.run(2, progress=False)
    assert whole["reward_mean"].iloc[2:].sum() > 0  # the sums are answered, so the rewards tell runs apart
    # bit for bit, but for the sampler's own log-probs: which episodes share a sampler call depends on when their
    # games answer, and a batch's padding moves the sampler's float32 log-probs (not its seeded tokens)
    noisy = [c for c in whole.columns if c.startswith(("sampler_mismatch", "sampler_kl", "sampler_ratio"))]
    exact = [c for c in whole.columns if not c.startswith("time_") and c not in noisy]
    assert noisy and rest[exact].iloc[-2:].reset_index(drop=True).equals(whole[exact].iloc[-2:].reset_index(drop=True))
    # 1e-5: a few float32 roundings of log-probs up to ~10 in magnitude (measured differences up to 1.9e-6)
    assert_close(torch.tensor(rest[noisy].iloc[-2:].values), torch.tensor(whole[noisy].iloc[-2:].values), atol=1e-5)


def test_longest_turns_by_hand():
    # episode 0: turn 0 has 2 sampled tokens, turn 1 has 3 (a tool result between them is not sampled); episode 1:
    # one turn of 1 token, then padding (turn -1)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    turn = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, -1, -1, -1, -1]])
    assert rl.algorithms.longest_turns(mask, turn).tolist() == [3.0, 1.0]


def test_dapo_overlong_shaping_measures_an_episodes_longest_turn(tiny_dir, tmp_path):
    """Each turn is capped at max_new_tokens, not the episode: a many-turn episode whose turns are short is not
    "overlong" (measured on its total, the penalty fell far below -1 and DAPO unlearned tool use on the calculator)."""
    s = rl.Session(model=sums_model(tiny_dir, tmp_path), task=sums_task(), algorithm="dapo", sampler="hf",
                   cluster="inline", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=6, seed=1)
    batch = s.score(s.rollout())
    mask, turn = batch["loss_mask"], batch["turn"]
    assert (mask.sum(-1) > 6).any()  # episodes longer in all than one turn's cap
    longest = [max(int(mask[b][turn[b] == t].sum()) for t in range(int(turn[b].max()) + 1)) for b in range(len(mask))]
    # DAPO's buffer: 0.2 of 6 tokens = 1.2; no penalty up to 4.8 tokens, -1 at 6
    expected = [min(-(n - 4.8) / 1.2, 0.0) for n in longest]
    assert batch["overlong_penalty"].tolist() == approx(expected)
    assert batch["overlong_penalty"].min() >= -1.0
    assert batch["reward"].tolist() == approx((batch["score"] + batch["overlong_penalty"]).tolist())
    s.close()


def test_turn_credit_presets_refuse_single_turn_tasks(tiny_dir):
    with pytest.raises(ValueError, match="algorithm 'gigpo' credits each turn of an episode: it needs an agentic task"):
        rl.Session(model="tiny-arith", task="arithmetic", algorithm="gigpo", cluster="inline")


@pytest.mark.slow
def test_grpo_teaches_tiny_tools_to_use_its_calculator():
    """The built-in agentic task: tiny-tools calls its tool sometimes, correctly sometimes (held-out greedy accuracy
    within tiny_tools.STOP_AT..OVERSHOOT after its warm start); 25 GRPO steps over whole episodes raise the accuracy, the reward and how often it
    calls the tool. (Not the share of calls that succeed: it starts near 0.9 and, with more calls, seeds 0 and 1
    end lower, 0.92 -> 0.86 and 0.90 -> 0.75.)"""
    s = rl.Session(model="tiny-tools", task="calculator", algorithm="grpo", cluster="inline", seed=0,
                   prompts_per_step=8, samples_per_prompt=8, max_new_tokens=64, lr=3e-4, threads=1)
    before = s.evaluate(max_prompts=100)["greedy_accuracy"]
    metrics = s.run(steps=25, progress=False)
    after = s.evaluate(max_prompts=100)["greedy_accuracy"]
    assert after >= before + 0.15, (before, after)
    assert metrics["tool_calls_mean"][-5:].mean() > metrics["tool_calls_mean"][:5].mean() + 0.1
    assert metrics["reward_mean"][-5:].mean() > metrics["reward_mean"][:5].mean() + 0.1
    s.close()
