"""Learned rewards: a reward model from a local directory (built offline here) and an LLM judge (a stub server)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from floats import approx
from transformers import Qwen2Config, Qwen2ForSequenceClassification

import rlbench as rl
from rlbench.rewards import LLMJudge, RewardModel, score_all
from rlbench.rewards.judge import parse_score
from rlbench.samplers import HFSampler, SamplingParams

EXAMPLES = [{"prompt": "12+34=", "answer": "46"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
             "reward_model": {"ground_truth": "4"}}]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier (one label) with the tiny models' tokenizer, saved like any HF model."""
    path = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = rl.models.build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_reward_model_scores_equal_unpadded_forwards(reward_model_dir):
    rm = RewardModel(reward_model_dir, batch_size=2)
    completions = ["46", "a much longer completion"]
    scores = rm(completions, EXAMPLES)
    texts = ["12+34=46", "system: Be brief.\nuser: 2+2=\nassistant:a much longer completion"]  # plain rendering
    with torch.no_grad():
        for text, score in zip(texts, scores):
            ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
            assert score == approx(float(rm.model(**ids).logits[0, 0]), abs=1e-5)  # 1e-5: a padded batch
    assert scores[0] != scores[1]


def test_reward_model_through_the_runner_and_with_a_chat_template(reward_model_dir):
    rm = RewardModel(reward_model_dir, batch_size=1)
    scores = score_all(rm, ["46", "4"], EXAMPLES, timeout_s=60)  # batched: one call
    assert scores.error == [None, None] and scores.score == approx(rm(["46", "4"], EXAMPLES))
    rm.tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                  "{% if add_generation_prompt %}<assistant>{% endif %}")
    templated = rm(["4"], EXAMPLES[1:])[0]
    text = "<system>Be brief.<user>2+2=<assistant>4"
    with torch.no_grad():
        direct = rm.model(**rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    assert templated == approx(float(direct), abs=1e-5)  # 1e-5: the runner's batch vs one unpadded forward


def test_long_texts_keep_their_end(reward_model_dir):
    rm = RewardModel(reward_model_dir, max_tokens=8)
    [short], [long] = rm(["46"], EXAMPLES[:1]), rm(["46"], [{"prompt": "x" * 50 + "12+34="}])
    assert short == approx(long, abs=1e-5)  # both end in the same 8 tokens "12+34=46" (1e-5: other padding)


# --- LLM judge --------------------------------------------------------------------------------------------
class StubJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/chat/completions: "SCORE: 10" when the response to grade equals the
    reference, "SCORE: 0" otherwise, a reply without a score for "mumble", HTTP 500 for "crash"."""

    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StubJudge.requests.append((self.path, self.headers.get("Authorization"), body))
        prompt = body["messages"][0]["content"]
        reference = prompt.split("Reference answer:\n")[1].split("\n")[0]
        response = prompt.split("Response:\n")[1].split("\n")[0]
        if response == "crash":
            self.send_error(500, "judge is down")
            return
        right = response == reference
        reply = "Hmm." if response == "mumble" else f"Looks {'right' if right else 'wrong'}.\nSCORE: {10 * right}"
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_judge_over_http(judge_url):
    judge = LLMJudge(url=judge_url, model="stub-judge", api_key="sk-test")
    completions = ["46", "4", "5", "mumble", "crash"]
    examples = [EXAMPLES[0], EXAMPLES[1], EXAMPLES[1], EXAMPLES[1], EXAMPLES[1]]
    scores = score_all(judge, completions, examples, on_error="zero", timeout_s=60)
    assert scores.score == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert scores.error[:3] == [None, None, None]
    assert scores.error[3].startswith("ValueError: the judge's reply has no 'SCORE: n'")
    assert scores.error[4].startswith("HTTPError: HTTP Error 500")
    path, auth, body = StubJudge.requests[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "stub-judge" and body["temperature"] == 0.0


def test_judge_prompt_has_question_reference_and_response():
    judge = LLMJudge(generate=lambda prompts: ["SCORE: 7"] * len(prompts))
    prompt = judge.judge_prompt("four", EXAMPLES[1])
    assert "Question:\n2+2=\n" in prompt and "Reference answer:\n4\n" in prompt and "Response:\nfour\n" in prompt
    assert judge(["four"], EXAMPLES[1:]) == [0.7]


def test_judge_with_a_local_sampler(tiny):
    """The judge through a sampler (how the session's own sampler plugs in): tiny-arith never writes a
    score, so every sample records that, none is silently scored."""
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    def generate(prompts):
        ids = [tokenizer.encode(p) for p in prompts]
        out = sampler.generate(ids, SamplingParams(max_new_tokens=4, temperature=0))
        return tokenizer.batch_decode(out["response_ids"], skip_special_tokens=True)

    judge = LLMJudge(generate=generate, template="{question}{completion}")
    scores = score_all(judge, ["4"], [{"prompt": "12+3"}], on_error="zero")
    assert scores.error[0].startswith("ValueError: the judge's reply has no 'SCORE: n'")


@pytest.mark.parametrize(("reply", "score"), [("SCORE: 10", 1.0), ("score: 3\n", 0.3), ("SCORE: 2 ... SCORE: 8", 0.8),
                                              ("SCORE: 12", 1.0)])
def test_parse_score(reply, score):
    assert parse_score(reply) == approx(score)


def test_judge_needs_exactly_one_backend():
    with pytest.raises(ValueError, match="exactly one"):
        LLMJudge()
    with pytest.raises(ValueError, match="exactly one"):
        LLMJudge(url="http://x", generate=lambda p: p)
