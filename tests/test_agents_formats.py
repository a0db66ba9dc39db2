"""Tool-call formats of the major model families: the parsers on texts worked out by hand, and episodes' append-only
rendering on the families' real chat templates (Qwen2.5, Qwen3, Llama 3.x, gpt-oss), as TRL ships them in its
package (trl/chat_templates/; the tests skip, saying so, where trl is not installed).

The tokenizer is the built-in tiny-tools one (one token per byte, besides `<tool_call>` and `</tool_call>`): a
template's text is the same whichever tokenizer encodes it, and before the first tool-call tag a token position is a
character position."""

import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import pytest

import rlbench as rl
from rlbench.agents import Renderer, check_template, get_parser, tool
from rlbench.agents.parsers import tool_messages
from rlbench.models.tiny_tools import build_tools_tokenizer
from rlbench.samplers import ScriptedSampler


@tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "3*4".
    """
    return expression  # the tests declare it (its schema) and never run it


TOOLS = [calc.schema]


def real_template(name: str) -> str:
    """The text of trl/chat_templates/`name` from the installed trl (skips the test without trl)."""
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl is not installed: the real chat templates are read from its package (pip install -e .[dev])")
    path = Path(spec.origin).parent / "chat_templates" / name
    if not path.exists():
        pytest.skip(f"this trl has no {path.name} (in {path.parent})")
    return path.read_text()


def tokenizer_with(template: str):
    tokenizer = build_tools_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>"})  # the Llama templates write one
    tokenizer.chat_template = template
    return tokenizer


def qwen_call(expression: str) -> str:
    """A call as Qwen's templates write it (and Qwen models sample it)."""
    return '<tool_call>\n{"name": "calc", "arguments": ' + json.dumps({"expression": expression}) + "}\n</tool_call>"


def llama_call(expression: str) -> str:
    return '{"name": "calc", "parameters": ' + json.dumps({"expression": expression}) + "}"


def harmony_call(expression: str) -> str:
    """A call as gpt-oss's template writes it, after the generation prompt `<|start|>assistant`."""
    arguments = json.dumps({"expression": expression})
    return " to=functions.calc<|channel|>commentary json<|message|>" + arguments + "<|call|>"


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in calls]


# ------------------------------------------------------------------------------------------------- parsers
def test_qwen3_calls_inside_the_reasoning_are_not_read():
    parser = get_parser("qwen")
    thought = "<think>\nI could send <tool_call>\n{\"name\": \"calc\"}\n</tool_call> but first\n</think>\n\n"
    calls, errors = parser.parse(thought + qwen_call("2*3"))
    assert named(calls) == [("calc", {"expression": "2*3"})] and errors == []  # the unreadable one is reasoning
    assert parser.parse("<think>\nmaybe " + qwen_call("2*3")) == ([], [])  # cut while thinking: no call yet
    message = parser.assistant_message(thought + qwen_call("2*3"), calls)
    # the reasoning stays in the content (Qwen3's template splits it off itself), the call goes to tool_calls
    assert message["content"] == thought.strip()
    assert message["tool_calls"] == [{"id": "call_0", "type": "function",
                                      "function": {"name": "calc", "arguments": {"expression": "2*3"}}}]
    assert parser.assistant_message("6", []) == {"role": "assistant", "content": "6"}
    assert tool_messages(parser, calls, ["6", "error: x"]) == [
        {"role": "tool", "content": "6", "name": "calc", "tool_call_id": "call_0"},
        {"role": "tool", "content": "error: x"}]


def test_llama3_reads_one_json_call_per_turn():
    parser = get_parser("llama3")
    assert parser.stop == ("<|eom_id|>",)
    for text in ('<|python_tag|>{"name": "calc", "parameters": {"expression": "2*3"}}<|eom_id|>',
                 ' {"name": "calc", "parameters": {"expression": "2*3"}}',
                 '{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}<|eot_id|>'):
        calls, errors = parser.parse(text)
        assert named(calls) == [("calc", {"expression": "2*3"})] and errors == [], text
    assert parser.parse("It is 6.") == ([], [])  # an answer
    assert parser.parse("<|python_tag|>calc('2*3')") == (
        [], ["after <|python_tag|> comes a JSON tool call, got \"calc('2*3')\""])
    calls, errors = parser.parse(llama_call("2*3") + "; " + llama_call("4*5"))
    assert named(calls) == [("calc", {"expression": "2*3"})]
    assert errors == ["one tool call per turn: ignored what follows the call, " + repr("; " + llama_call("4*5"))]
    _, errors = parser.parse('{"name": "calc", "parameters": {"expression": ')
    # the value is missing at the end of the stripped text: 9 + 8 + 14 + 14 characters
    assert errors == ["malformed tool call JSON (Expecting value at character 45): "
                      + repr('{"name": "calc", "parameters": {"expression":')]
    _, errors = parser.parse('{"name": "calc", "parameters": 3}')
    assert errors == ['a tool call is {"name": <string>, "parameters": <object>}, got '
                      + repr('{"name": "calc", "parameters": 3}')]
    calls, _ = parser.parse(llama_call("2*3"))
    assert parser.assistant_message(llama_call("2*3"), calls)["tool_calls"][0]["function"]["name"] == "calc"


def test_gpt_oss_reads_harmony_messages():
    parser = get_parser("gpt-oss")
    assert parser.stop == ("<|call|>",)
    sampled = ('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.calc <|constrain|>json<|message|>{"expression": "2*3"}<|call|>')
    calls, errors = parser.parse(sampled)
    assert named(calls) == [("calc", {"expression": "2*3"})] and errors == []
    assert named(parser.parse(harmony_call("2*3"))[0]) == [("calc", {"expression": "2*3"})]  # the template's order
    assert parser.assistant_message(sampled, calls) == {
        "role": "assistant", "content": "", "thinking": "Multiply.",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "calc",
                                                                        "arguments": {"expression": "2*3"}}}]}
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>6"
    assert parser.parse(answer) == ([], [])
    assert parser.assistant_message(answer, []) == {"role": "assistant", "content": "6", "thinking": "Easy."}
    bad = " to=functions.calc<|channel|>commentary json<|message|>{\"expression\": <|call|>"
    # the value is missing at the end of the (stripped) 14 characters
    assert parser.parse(bad) == ([], ["malformed tool call JSON (Expecting value at character 14): '{\"expression\":'"])
    # an unreadable call still names the function its error answers as
    assert parser.assistant_message(bad, [])["tool_calls"][0]["function"] == {"name": "calc",
                                                                              "arguments": '{"expression": '}
    assert parser.parse("<|channel|>commentary to=python<|message|>print(6)<|call|>") == (
        [], ["tool calls go to functions.NAME (the tools declared), got to=python"])
    assert parser.parse("<|channel|>commentary to=functions.calc<|message|>{\"expression\": \"2") == (
        [], ["unterminated tool call to functions.calc (no <|call|>): '{\"expression\": \"2'"])


# --------------------------------------------------------------------------------------- real templates
def conversation(calls: list[str], results: list[str], answer: str, *, per_turn: bool) -> list[dict]:
    """A question, the calls (all in one turn, or one turn each with its result after it), the answer."""
    messages = [{"role": "user", "content": "What is 12*45 + 3*4?"}]
    if per_turn:
        for text, result in zip(calls, results):
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    else:
        messages += [{"role": "assistant", "content": "\n".join(calls)}]
        messages += [{"role": "tool", "content": result} for result in results]
    return messages + [{"role": "assistant", "content": answer}]


FAMILIES = {  # template, parser, the two calls as the model writes them, the answer, one call per turn
    "qwen2.5": ("qwen2_5.jinja", "qwen", [qwen_call("12*45"), qwen_call("3*4")], "552", False),
    "qwen3": ("qwen3.jinja", "qwen", ["<think>\nTwo products.\n</think>\n\n" + qwen_call("12*45"), qwen_call("3*4")],
              "<think>\nAdd them.\n</think>\n\n552", False),
    "llama3": ("llama3_1.jinja", "llama3", [llama_call("12*45"), llama_call("3*4")], "552", True),
    "gpt-oss": ("gptoss.jinja", "gpt-oss", [harmony_call("12*45"), harmony_call("3*4")],
                "<|channel|>final<|message|>552", True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tool_calls_append_exactly_what_the_real_template_renders(family):
    name, parser, calls, answer, per_turn = FAMILIES[family]
    tokenizer = tokenizer_with(real_template(name))
    messages = conversation(calls, ["540", "12"], answer, per_turn=per_turn)
    report = check_template(tokenizer, messages, TOOLS, parser=get_parser(parser))
    assert report.ok and len(report.turns) == (3 if per_turn else 2), report


def test_a_template_that_renders_no_tool_calls_gets_the_sampled_text():
    """tiny-tools' template and Llama 3's first (before tool calling) write an assistant message's content only: the
    messages they get keep each turn's text as its content, and the check passes with the parser too."""
    for tokenizer, parser, calls in [(build_tools_tokenizer(), "qwen", [qwen_call("12*45"), qwen_call("3*4")]),
                                     (tokenizer_with(real_template("llama3.jinja")), "llama3",
                                      [llama_call("12*45"), llama_call("3*4")])]:
        assert not Renderer(tokenizer, TOOLS).renders_tool_calls
        messages = conversation(calls, ["540", "12"], "552", per_turn=True)
        assert check_template(tokenizer, messages, TOOLS, parser=get_parser(parser)).ok


def test_gpt_oss_appends_the_tool_result_after_a_sampled_call_as_the_function_answering():
    """The model writes the recipient after the channel (the template before it) and adds `<|constrain|>`: the
    sampled tokens stay, and what follows is the tool message the template writes after that call."""
    tokenizer = tokenizer_with(real_template("gptoss.jinja"))
    parser = get_parser("gpt-oss")
    sampled = ('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.calc <|constrain|>json<|message|>{"expression": "12*45"}<|call|>')
    calls, _ = parser.parse(sampled)
    renderer = Renderer(tokenizer, TOOLS)
    ids, kinds, _ = renderer.continuation(sampled, tool_messages(parser, calls, ["540"]),
                                       parser.assistant_message(sampled, calls))
    text = '<|start|>functions.calc to=assistant<|channel|>commentary<|message|>"540"<|end|><|start|>assistant'
    assert tokenizer.decode(ids) == text
    assert [i for i, kind in enumerate(kinds) if kind == 2] == [text.index("540") + k for k in range(3)]
    # without the assistant's tool call the template cannot name the result: a ValueError saying so
    with pytest.raises(ValueError, match=r"cannot render messages shaped \[user\{content\}, assistant\{content\}, "
                                         r"tool\{content\}\]: TemplateError: Message has tool role, but there was "
                                         r"no previous assistant message with a tool call!"):
        renderer.continuation("x", [{"role": "tool", "content": "540"}])


def test_a_template_that_drops_earlier_reasoning_is_reported_with_what_to_do():
    """Qwen3's template drops the reasoning of the turns before the last user message; its training version
    (TRL's qwen3_training.jinja) keeps it."""
    messages = [{"role": "user", "content": "12*45?"}, {"role": "assistant", "content": "<think>\nm\n</think>\n\n540"},
                {"role": "user", "content": "and 3*4?"}, {"role": "assistant", "content": "<think>\nm\n</think>\n\n12"}]
    tokenizer = tokenizer_with(real_template("qwen3.jinja"))
    report = check_template(tokenizer, messages, parser=get_parser("qwen"))
    # turn 0 differs once the next user message follows: right after "<|im_start|>assistant\n", the whole render
    # starts with the answer where the episode has its reasoning
    position = len("<|im_start|>user\n12*45?<|im_end|>\n<|im_start|>assistant\n")
    assert report.turns[0]["position"] == position and report.turns[1]["position"] == position
    assert report.turns[0]["appended"] == "<think>\n" and report.turns[0]["whole"] == "540<|im_"
    text = str(report)
    assert text.startswith("template is NOT append-only") and f"turn 0: first difference at token {position}" in text
    assert "qwen3_training.jinja" in text and "tokenizer.chat_template" in text and "accept it" in text
    tokenizer.chat_template = real_template("qwen3_training.jinja")
    assert check_template(tokenizer, messages, parser=get_parser("qwen")).ok


# ------------------------------------------------------------------------------------------------ an episode
class Products(rl.Env):
    """The example's question; `calc` multiplies; reward 1 for the right answer after the reasoning."""

    def reset(self, prompt, answer):
        self.answer = answer
        return prompt

    @rl.tool
    def calc(self, expression: str) -> str:
        """Multiply two numbers.

        Args:
            expression: e.g. "3*4".
        """
        a, b = expression.split("*")
        return str(int(a) * int(b))

    def reward(self, episode) -> float:
        return float(episode.final_text.split("</think>")[-1].strip() == self.answer)


def test_a_qwen3_episode_with_two_calls_in_a_turn(chat_dir, tmp_path):
    """An episode on Qwen3's real template: one turn reasons and calls twice, both results come back as the
    template writes them (one user turn of two tool responses), then the answer."""
    path = tmp_path / "qwen3"
    shutil.copytree(chat_dir, path)
    config = json.loads((path / "config.json").read_text())  # room for Qwen3's tool prompt, a token per character
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    tokenizer = rl.models.load_tokenizer(path)
    tokenizer.chat_template = real_template("qwen3.jinja")
    tokenizer.save_pretrained(path)
    calls = "<think>\nTwo products.\n</think>\n\n" + qwen_call("12*45") + "\n" + qwen_call("3*4")
    answer = "<think>\nAdd them.\n</think>\n\n552"

    def respond(context: str) -> list[int]:
        text = answer if "<tool_response>" in context else calls
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    example = {"prompt": "What is 12*45 + 3*4?", "answer": "552"}
    task = rl.tasks.AgentTask([example], [example], env=Products, max_turns=3, parser="qwen")
    with warnings.catch_warnings():  # the start-up check's own conversation answers without reasoning, which
        warnings.simplefilter("ignore", UserWarning)  # Qwen3's template gives an empty think block: it warns
        s = rl.Session(model=str(path), task=task, sampler=ScriptedSampler(tokenizer, respond), cluster="inline",
                       prompts_per_step=1, samples_per_prompt=2, max_new_tokens=400)
    ep = s.episode(example)
    ep.step()
    assert named(ep.pending_tool_calls) == [("calc", {"expression": "12*45"}), ("calc", {"expression": "3*4"})]
    assert ep.messages[-1]["tool_calls"][1]["function"] == {"name": "calc", "arguments": {"expression": "3*4"}}
    ep.step()
    assert [m["name"] for m in ep.messages[-2:]] == ["calc", "calc"]
    ep.step()
    # the tiny tokenizer's EOS is "<eos>", not Qwen's "<|im_end|>": the template's end of turn follows it
    assert tokenizer.decode(ep.ids) == (
        calls + "<eos><|im_end|>\n<|im_start|>user\n<tool_response>\n540\n</tool_response>\n<tool_response>\n12\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n" + answer + "<eos>")
    assert ep.done and ep.reward() == 1.0
    table = ep.to_pandas()
    assert "".join(table[table.kind == "tool"].text) == "54012"
    s.close()


def test_a_session_on_gpt_oss_s_template_starts_and_says_its_check_could_not_run(chat_dir, tmp_path):
    """The start-up check's conversation has a tool result without a call before it, which gpt-oss's template
    refuses to render (it names a result after its call): the session warns saying so, and starts."""
    path = tmp_path / "gptoss"
    shutil.copytree(chat_dir, path)
    config = json.loads((path / "config.json").read_text())  # room for gpt-oss's tool prompt, a token per character
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    tokenizer = rl.models.load_tokenizer(path)
    tokenizer.chat_template = real_template("gptoss.jinja")
    tokenizer.save_pretrained(path)
    example = {"prompt": "What is 12*45 + 3*4?", "answer": "552"}
    task = rl.tasks.AgentTask([example], [example], env=Products, max_turns=3, parser="gpt-oss")
    with pytest.warns(UserWarning, match=r"template could not be checked: .*tool"):
        s = rl.Session(model=str(path), task=task, sampler=ScriptedSampler(tokenizer, lambda context: "552"),
                       cluster="inline", prompts_per_step=1, samples_per_prompt=2, max_new_tokens=400)
    s.close()
