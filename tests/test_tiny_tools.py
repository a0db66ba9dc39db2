"""tiny-tools and the calculator: the tokenizer with tool-call tokens and chat template, the episodes it was
warm-started on (token for token), the safe `calc` tool, the Calculator environment, and the built model."""

import inspect
import json
import typing
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

import rlbench.models as models
from rlbench.agents import tools_of
from rlbench.models import calculator_data as data
from rlbench.models import tiny_tools
from rlbench.models.warm_start import sft_tensors
from rlbench.tasks.calculator import Calculator, calculator_split

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call>'
CONVERSATION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "37*48="},
                {"role": "assistant", "content": CALL}, {"role": "tool", "content": "1776"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tools.build_tools_tokenizer()


def chars(tokenizer, text):
    """One id per character, the ids of the tokenizer without the markup tokens."""
    ids = models.build_tokenizer().encode(text)
    assert len(ids) == len(text)
    return ids


# --- tokenizer -----------------------------------------------------------------------------------


def test_tool_call_markup_is_one_token_each_in_text(tokenizer):
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert (start, end) == (259, 260) and len(tokenizer) == 261
    ids = tokenizer.encode(CALL)
    assert ids[0] == start and ids[-1] == end and start not in ids[1:-1] and end not in ids[:-1]
    assert len(ids) == len(CALL) - len("<tool_call></tool_call>") + 2
    assert tokenizer.decode(ids) == CALL
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == CALL  # not special
    assert len(tokenizer.encode("<eos>")) == 5  # special tokens typed as text stay text
    assert tokenizer.encode("12+34=") == models.build_tokenizer().encode("12+34=")  # bytes keep their ids


def test_tokenizer_survives_save_and_load(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "Q:37*48=\nA:" + CALL + "\nR:1776\nA:1776 <eos> <tool_call"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.chat_template == tokenizer.chat_template == tiny_tools.CHAT_TEMPLATE
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (1, 0, "left")
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False)


def test_chat_template_renders_one_line_per_message(tokenizer):
    assert data.render(tokenizer, CONVERSATION, add_generation_prompt=True) == (
        "Use the calculator.\nQ:37*48=\nA:" + CALL + "\nR:1776\nA:")
    assert data.render(tokenizer, CONVERSATION[1:2]) == "Q:37*48=\n"


def test_chat_template_is_append_only(tokenizer):
    """The whole conversation renders as the concatenation of each message's own rendering, and a
    generation prompt is the start of the next assistant message."""
    def render(messages):
        return data.render(tokenizer, messages) if messages else ""

    whole = render(CONVERSATION)
    pieces = [render(CONVERSATION[: k + 1])[len(render(CONVERSATION[:k])):] for k in range(len(CONVERSATION))]
    assert pieces == ["Use the calculator.\n", "Q:37*48=\n", "A:" + CALL + "\n", "R:1776\n"]
    assert all(render(CONVERSATION[: k + 1]).startswith(render(CONVERSATION[:k])) for k in range(len(CONVERSATION)))
    assert "".join(pieces) == whole
    assert tokenizer.encode(whole) == sum((tokenizer.encode(p) for p in pieces), [])
    with_prompt = data.render(tokenizer, CONVERSATION[:2], add_generation_prompt=True)
    assert render(CONVERSATION[:3]).startswith(with_prompt)


# --- episodes --------------------------------------------------------------------------------------


def test_tool_episode_is_the_episode_format_token_for_token(tokenizer):
    ids, sampled = data.tool_episode(tokenizer, 37, 48)
    prompt = chars(tokenizer, "Q:37*48=\nA:")
    call = [259] + chars(tokenizer, '{"name": "calc", "arguments": {"expression": "37*48"}}') + [260]
    observation = chars(tokenizer, "\nR:1776\nA:")
    answer = chars(tokenizer, "1776") + [tokenizer.eos_token_id]
    assert ids == prompt + call + observation + answer
    assert sampled == [False] * len(prompt) + [True] * len(call) + [False] * len(observation) + [True] * len(answer)
    assert tokenizer.decode(ids[: len(prompt)]) == data.render(tokenizer, data.example(37, 48)["prompt"],
                                                                add_generation_prompt=True)
    assert tokenizer.decode(ids[:-len(answer)]) == data.render(tokenizer, CONVERSATION[1:], add_generation_prompt=True)


def test_direct_episode_and_sft_labels(tokenizer):
    ids, sampled = data.direct_episode(tokenizer, 10, 12)
    assert ids == chars(tokenizer, "Q:10*12=\nA:120") + [tokenizer.eos_token_id]
    assert sampled == [False] * 11 + [True] * 4
    rows = [data.tool_episode(tokenizer, 99, 99), (ids, sampled)]
    inputs_N_T, labels_N_T = sft_tensors(rows, tokenizer.pad_token_id)
    assert inputs_N_T.shape == (2, len(rows[0][0]))
    assert inputs_N_T[1].tolist() == ids + [tokenizer.pad_token_id] * (inputs_N_T.shape[1] - len(ids))
    for (row_ids, row_sampled), labels in zip(rows, labels_N_T.tolist()):
        assert labels[: len(row_ids)] == [i if s else -100 for i, s in zip(row_ids, row_sampled)]
        assert set(labels[len(row_ids):]) <= {-100}


def test_mixture_calls_the_tool_mostly_on_big_products(tokenizer):
    mixture = tiny_tools.mixture(tokenizer)
    train = data.calculator_pairs()[0]
    assert len(mixture) == len(train)
    calls = [259 in ids for ids, _ in mixture]
    big = [a * b >= tiny_tools.BIG_PRODUCT for a, b in train]
    big_calls = [c for c, b in zip(calls, big) if b]
    small_calls = [c for c, b in zip(calls, big) if not b]
    assert 0.85 < sum(big_calls) / len(big_calls) < 0.95 and 0.05 < sum(small_calls) / len(small_calls) < 0.15


def test_parse_tool_call():
    assert data.parse_tool_call(CALL) == "37*48"
    assert data.parse_tool_call("I'll use it: " + data.tool_call_text("(1+2)*3")) == "(1+2)*3"
    for bad in ["1776", CALL[:-1], CALL.replace('"calc"', '"calculator"'), CALL.replace("}}", "}"),
                "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": 3}}) + "</tool_call>",
                "<tool_call>" + json.dumps({"name": "calc", "arguments": {"x": "1"}}) + "</tool_call>"]:
        assert data.parse_tool_call(bad) is None, bad


# --- the calc tool -----------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("37*48", "1776"), ("(3+4)*5", "35"), (" 2 ** 10 ", "1024"), ("-3+2", "-1"), ("6/4", "1.5"),
    ("1/3", "0.3333333333"), ("10/5*3", "6"), ("2**-2", "0.25"), ("9**99", str(9**99)),
])
def test_calc_evaluates_exactly(expression, value):
    assert data.calc(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os')", "not allowed"), ("().__class__", "not allowed"), ("x+1", "not allowed"),
    ("1.5*2", "not allowed"), ("True+1", "not allowed"), ("3 % 2", "not allowed"), ("1/0", "division by zero"),
    ("0**-1", "division by zero"), ("9**999999", "exponent"), ("2**(1/2)", "exponent"), ("(10**99)**2", "digits"),
    ("1" * 101, "digits"), ("1+" * 100 + "1", "characters"), ("37*", "cannot parse"), ("", "cannot parse"),
])
def test_calc_refuses_with_a_clear_error(expression, why):
    with pytest.raises(ValueError, match=why):
        data.calc(expression)


# --- the calculator task's data and environment ------------------------------------------------------


def test_split_is_fixed_and_disjoint():
    train, test = calculator_split()
    assert (len(train), len(test)) == (7900, 200)
    assert calculator_split() == (train, test)
    assert {(e["a"], e["b"]) for e in train}.isdisjoint((e["a"], e["b"]) for e in test)
    example = test[0]
    assert example["prompt"] == [{"role": "user", "content": f"{example['a']}*{example['b']}="}]
    assert example["answer"] == str(example["a"] * example["b"])


def test_calculator_environment():
    example = data.example(37, 48)
    env = Calculator()
    messages = env.reset(**example)
    assert messages == [{"role": "user", "content": "37*48="}] and messages is not example["prompt"]
    assert env.calc("37*48") == "1776"
    with pytest.raises(ValueError, match="not allowed"):
        env.calc("open('x')")
    assert env.reward(SimpleNamespace(final_text=" 1776\n")) == {"score": 1.0, "acc": 1.0}
    for wrong in ["1777", "17760", "", "1776 is the answer"]:
        assert env.reward(SimpleNamespace(final_text=wrong)) == {"score": 0.0, "acc": 0.0}


def test_calc_signature_and_docstring_declare_the_tool():
    """Its one tool is its marked method calc(expression: str) -> str, documented."""
    tools = tools_of(Calculator)
    assert list(tools) == ["calc"]
    assert list(inspect.signature(tools["calc"].fn).parameters) == ["self", "expression"]
    assert typing.get_type_hints(tools["calc"].fn) == {"expression": str, "return": str}
    doc = inspect.getdoc(tools["calc"].fn)
    assert doc.splitlines()[0] and "Args:\n    expression: " in doc


# --- the built model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    return models.load("tiny-tools")


@pytest.mark.slow
def test_built_model_calls_the_tool_sometimes_and_is_right_sometimes(built):
    model, tok = built
    assert models.resolve("tiny-tools").name == f"tiny-tools-v{tiny_tools.VERSION}-seed0"
    assert (model.config.vocab_size, model.config.max_position_embeddings) == (261, tiny_tools.MAX_POSITIONS)
    assert tok.chat_template == tiny_tools.CHAT_TEMPLATE
    metrics = tiny_tools.episode_metrics(model, tok, data.calculator_pairs()[1])
    assert tiny_tools.STOP_AT <= metrics["acc"] <= tiny_tools.OVERSHOOT
    assert 0.2 <= metrics["tool_calls"] <= 0.9
    assert metrics["acc"] <= metrics["well_formed"] <= metrics["tool_calls"]


@pytest.mark.slow
@torch.no_grad()
def test_episode_metrics_agree_with_a_plain_greedy_loop(built):
    """Episodes by hand (no KV cache, no generate, no batching) on 24 held-out problems: same accuracy."""
    model, tok = built
    pairs = data.calculator_pairs()[1][::8]
    eos, end = tok.eos_token_id, tok.convert_tokens_to_ids("</tool_call>")

    def greedy(ids, budget):
        out = []
        while len(out) < budget and out[-1:] not in ([eos], [end]):
            out.append(model(torch.tensor([ids + out])).logits[0, -1].argmax().item())
        return out

    right = 0
    for a, b in pairs:
        prompt = tok.encode(f"Q:{a}*{b}=\nA:")
        turn = greedy(prompt, tiny_tools.TURN_TOKENS)
        expression = data.parse_tool_call(tok.decode(turn)) if turn[-1:] == [end] else None
        if expression is not None:
            turn = greedy(prompt + turn + tok.encode(f"\nR:{data.calc(expression)}\nA:"), tiny_tools.ANSWER_TOKENS)
        right += turn[-1:] == [eos] and tok.decode(turn[:-1]).strip() == str(a * b)
    batched = tiny_tools.episode_metrics(model, tok, pairs)["acc"]
    assert abs(right / len(pairs) - batched) <= 1 / len(pairs)  # at most one near-tie decided differently


def test_build_is_deterministic(monkeypatch):
    """Two builds of seed 0 give the same weights (the build stopped at its first check: a whole build is 300-700
    steps, and a step that differs shows in the first ones as well)."""
    monkeypatch.setattr(tiny_tools, "STOP_AT", 0.0)
    monkeypatch.setattr(tiny_tools, "OVERSHOOT", 1.0)
    first, second = (tiny_tools.train_tiny_tools(0)[0].state_dict() for _ in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), [k for k in first if not torch.equal(first[k], second[k])]
