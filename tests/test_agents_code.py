"""The python tool (`rl.agents.python_tool`) on real sandbox runs, and agentic sessions that call it on a scripted
sampler: a custom AgentTask and the built-in `tool_math` task over verl-schema files."""

import threading
import time

import cloudpickle
import pytest

import rlbench as rl
from agent_games import call
from rlbench.samplers import ScriptedSampler


@pytest.fixture(scope="module")
def tokenizer(chat_dir):
    return rl.models.load_tokenizer(chat_dir)


@pytest.fixture(scope="module")
def python():
    # 3 s: a sandboxed program starts in ~0.1 s, ~0.5 s on a busy machine; the programs that hit it never end
    return rl.agents.python_tool(timeout_s=3.0, memory_mb=256, max_output_chars=200, output_bytes=1 << 16)


# ------------------------------------------------------------------------------------------- the tool
def test_the_tool_is_described_to_the_model(python):
    assert python.name == "python" and list(python.params) == ["code"]
    function = python.schema["function"]
    assert function["parameters"]["required"] == ["code"]
    assert "fresh process" in function["description"] and "3 s" in function["description"]
    assert "256 MB" in function["description"] and "print()" in function["parameters"]["properties"]["code"]["description"]


def test_print_returns_stdout(python):
    assert python(code="print(6*7)") == "42\n"
    assert python(code="x = 6*7") == "(the program printed nothing: print() the values you want to see)"


def test_an_exception_returns_the_output_and_the_traceback_of_the_program_only(python):
    out = python(code="print('before')\nprint(1/0)")
    assert out.startswith("before\nTraceback (most recent call last):\n  File \"main.py\", line 2")
    assert out.endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in out  # the sandbox's bootstrap frames are not the model's
    assert python(code="import sys; sys.exit(3)") == "error: the program exited with code 3"


def test_a_program_that_does_not_compile_returns_the_error_as_text(python):
    # the attack: a syntax error, a NUL byte or a lone surrogate made the tool raise SandboxError
    assert python(code="print(1") == ('Traceback (most recent call last):\n  File "main.py", line 1\n    print(1\n'
                                      "         ^\nSyntaxError: '(' was never closed")
    assert python(code="print(1)\x00").endswith("\nSyntaxError: source code string cannot contain null bytes")
    assert python(code="print('\ud800')") == ("SyntaxError: the program is not UTF-8 text: surrogates not allowed at "
                                               "character 7")


def test_each_call_is_a_fresh_process(python):
    assert python(code="x = 1").startswith("(the program printed nothing")
    assert python(code="print(x)").endswith("NameError: name 'x' is not defined")


def test_an_infinite_loop_hits_the_time_limit(python):
    start = time.monotonic()
    assert python(code="print('start', flush=True)\nwhile True: pass") == (
        "start\nerror: timed out after 3 s (the time limit)")
    assert time.monotonic() - start < 60  # the loop never ends: it was stopped
    assert python(code="import time; time.sleep(3600)") == "error: timed out after 3 s (the time limit)"


def test_a_memory_bomb_hits_the_memory_limit(python):
    out = python(code="x = []\nwhile True: x.append(' ' * 10**6)")
    assert out.startswith("error: out of memory (the limit is 256 MB)\nTraceback") and out.endswith("MemoryError")


def test_too_much_output_is_cut_and_past_the_limit_stops_the_program(python):
    out = python(code="print('a' * 10**4 + 'z')")  # within output_bytes: cut to 200 characters, head and tail kept
    assert out.startswith("a" * 100 + "\n[... 9,802 characters cut ...]\n") and out.endswith("a" * 98 + "z\n")
    out = python(code="while True: print('spam')")  # past output_bytes (64 KiB): the write fails, the run ends
    assert out.endswith("error: the program wrote more than 65,536 bytes (the output limit) and was stopped")
    assert out.startswith("spam\n") and "characters cut" in out and len(out) < 500


def test_the_sandbox_blocks_processes_and_sockets(python):
    assert python(code="import os; os.system('ls')").startswith("error: the sandbox does not allow os.system")
    assert python(code="import socket; socket.socket()").startswith("error: the sandbox does not allow socket")


def test_the_tool_pickles_and_limits_concurrent_sandboxes():
    tool = cloudpickle.loads(cloudpickle.dumps(rl.agents.python_tool(timeout_s=30, max_concurrent=1)))
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(tool(code="import time; time.sleep(0.4); print('ok')")))
               for _ in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == ["ok\n", "ok\n"] and time.monotonic() - start >= 0.8  # one after the other
    with pytest.raises(ValueError, match="python_tool needs timeout_s > 0"):
        rl.agents.python_tool(timeout_s=0)


# ------------------------------------------------------------------------------------- agentic sessions
EXAMPLES = [{"prompt": f"What is {a}*{b}?", "data_source": "openai/gsm8k",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)}} for a, b in [(6, 7), (12, 45), (23, 56)]]


def scripted(tokenizer, turns: dict[int, str]):
    """Turn k (counted from the tool results in the context) is `turns[k]`; after that, "#### " and the first line
    of the last tool result."""
    def respond(context: str):
        k = context.count("<|tool|>")
        text = turns[k] if k in turns else "#### " + context.rsplit("<|tool|>", 1)[1].split("\n")[0]
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return ScriptedSampler(tokenizer, respond)


def grade(episode, example):
    return rl.rewards.gsm8k_reward(episode.final_text, example)


def test_a_session_calls_the_python_tool_and_grades_the_final_answer(chat_dir, tokenizer, python):
    task = rl.tasks.AgentTask(EXAMPLES, tools=[python], reward=grade, max_turns=3, tool_timeout_s=None)
    s = rl.Session(model=chat_dir, task=task, sampler=scripted(tokenizer, {0: call("python", code="print(6*7)")}),
                   cluster="inline", prompts_per_step=3, samples_per_prompt=2, max_new_tokens=120)
    ep = s.episode(EXAMPLES[0])
    ep.step()
    assert [(c.name, c.arguments) for c in ep.pending_tool_calls] == [("python", {"code": "print(6*7)"})]
    ep.step()  # the sandbox runs the code; what it printed comes back as the tool message
    assert ep.messages[-1] == {"role": "tool", "content": "42\n", "name": "python", "tool_call_id": "call_0"}
    ep.step()
    assert ep.done and ep.final_text == "#### 42" and ep.reward() == 1.0
    batch = s.score(s.rollout())
    assert batch["tool_calls"].tolist() == [1] * 6 and batch["tool_errors"].tolist() == [0] * 6
    right = [float(e["reward_model"]["ground_truth"] == "42") for e in batch["example"]]  # 42 is right for 6*7 only
    assert batch["score"].tolist() == right and sum(right) == 2
    s.close()


def test_code_that_fails_is_a_tool_result_the_model_reads(chat_dir, tokenizer, python):
    task = rl.tasks.AgentTask(EXAMPLES, tools=[python], reward=grade, max_turns=3, tool_timeout_s=None)
    s = rl.Session(model=chat_dir, task=task, sampler=scripted(tokenizer, {0: call("python", code="while 1: pass"),
                                                                          1: "#### 42"}),
                   cluster="inline", prompts_per_step=1, samples_per_prompt=2, max_new_tokens=120)
    ep = s.episode(EXAMPLES[0])
    ep.step().step()
    assert ep.messages[-1]["content"] == "error: timed out after 3 s (the time limit)"
    ep.step()
    assert ep.turns[0].errors == [] and ep.reward() == 1.0  # the code failed, not the tool call
    s.close()


def test_tool_math_is_a_built_in_task_over_verl_files(chat_dir, tokenizer, tmp_path):
    rows = [{**e, "prompt": [{"role": "user", "content": e["prompt"]}], "ability": "math"} for e in EXAMPLES]
    rl.tasks.write_rows(rows, tmp_path / "train.parquet")
    rl.tasks.write_rows(rows[:1], tmp_path / "test.jsonl")
    with pytest.raises(ValueError, match=r"1 of its 3 rows have the prompt of a row of the test set"):
        rl.tasks.get("tool_math", train=str(tmp_path / "train.parquet"), test=str(tmp_path / "test.jsonl"))
    task = rl.tasks.get("tool_math", train=str(tmp_path / "train.parquet"), test=str(tmp_path / "test.jsonl"),
                        duplicates="keep")  # (the test row is a training row: this test's shortcut)
    assert isinstance(task, rl.tasks.AgentTask) and task.name == "tool_math" and len(task.train) == 3
    assert task.test[0]["reward_model"]["ground_truth"] == "42" and task.tool_timeout_s is None
    assert [t.name for t in task.tools] == ["python"] and task.system == rl.tasks.tool_math.SYSTEM
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(2**10)"}}\n</tool_call>' in task.system
    # the default system prompt fills a 512-position context of one token per character: a short one here
    task = rl.tasks.get("tool_math", train=str(tmp_path / "train.parquet"), test=str(tmp_path / "test.jsonl"),
                        max_turns=2, timeout_s=30, shuffle=False, system="Use python.", duplicates="keep")
    sampler = scripted(tokenizer, {0: call("python", code="print(6*7)")})
    s = rl.Session(model=chat_dir, task=task, sampler=sampler, cluster="inline", prompts_per_step=1,
                   samples_per_prompt=2, max_new_tokens=120)
    ep = s.episode(task.test[0])
    ep.step().step().step()
    assert ep.final_text == "#### 42" and ep.reward() == 1.0
    assert sampler.calls[0][0].startswith("<|system|>Use python.\n<|user|>What is 6*7?")
    assert s.evaluate()["greedy_accuracy"] == 1.0
    s.close()
