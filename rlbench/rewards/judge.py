"""An LLM as the judge: the session's own sampler, or any OpenAI-compatible chat endpoint given by URL.

    judge = LLMJudge(url="http://127.0.0.1:8000/v1", model="qwen2.5-7b-instruct")   # POST {url}/chat/completions
    judge = LLMJudge(generate=session.complete)    # any function: list of prompt texts -> list of replies

The judge reads `template` filled with the question, the reference answer (if any) and the completion,
and must reply with "SCORE: n" (0-10); the reward is n / 10. A reply without a score, or a failed request,
is that sample's failure (recorded by the runner), not a zero.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlbench.models.chat import messages_of

TEMPLATE = """You are grading a response to a question.

Question:
{question}

Reference answer:
{reference}

Response:
{completion}

Judge whether the response answers the question correctly. End your reply with one line "SCORE: n",
n an integer from 0 (wrong) to 10 (fully correct)."""

_SCORE = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)", re.I)


def parse_score(reply: str) -> float:
    """The last "SCORE: n" of a reply, as n / 10 clipped to [0, 1]; ValueError when there is none."""
    found = _SCORE.findall(reply)
    if not found:
        raise ValueError(f"the judge's reply has no 'SCORE: n': {reply[-200:]!r}")
    return min(max(float(found[-1]) / 10, 0.0), 1.0)


class LLMJudge:
    """A `batched` reward: one judge prompt per sample, sent together (`concurrency` requests at a time)."""

    batched = True

    def __init__(self, *, url: str | None = None, model: str = "default", api_key: str | None = None,
                 generate: Callable[[list[str]], list[str]] | None = None, template: str = TEMPLATE,
                 max_tokens: int = 512, temperature: float = 0.0, request_timeout_s: float = 60.0,
                 concurrency: int = 8):
        if (url is None) == (generate is None):
            raise ValueError("give exactly one of url= (an OpenAI-compatible endpoint) and generate= (a function)")
        self.url, self.model, self.api_key, self.generate = url, model, api_key, generate
        self.template, self.max_tokens, self.temperature = template, max_tokens, temperature
        self.request_timeout_s, self.concurrency = request_timeout_s, concurrency

    def __call__(self, completions: Sequence[str], examples: Sequence[dict]) -> list[float | Exception]:
        prompts = [self.judge_prompt(c, e) for c, e in zip(completions, examples)]
        replies = self.generate(prompts) if self.generate else self._ask_all(prompts)
        return [r if isinstance(r, Exception) else _score_or_error(r) for r in replies]

    def judge_prompt(self, completion: str, example: dict) -> str:
        """The judge's prompt for one sample: the question is the last user message (or the prompt string)."""
        messages = messages_of(example["prompt"])
        users = [m["content"] for m in messages or [] if m["role"] == "user"]
        question = users[-1] if users else example["prompt"]
        reference = (example.get("reward_model") or {}).get("ground_truth", example.get("answer", "(none)"))
        return self.template.format(question=question, reference=reference, completion=completion)

    def _ask_all(self, prompts: list[str]) -> list[str | Exception]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._ask_or_error, prompts))

    def _ask_or_error(self, prompt: str) -> str | Exception:
        try:
            return self.ask(prompt)
        except Exception as e:  # recorded on its sample by the runner
            return e

    def ask(self, prompt: str) -> str:
        """One chat completion from the endpoint: POST {url}/chat/completions, the reply's text."""
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.url.rstrip('/')}/chat/completions", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
            return json.load(response)["choices"][0]["message"]["content"]

    def __repr__(self) -> str:
        backend = f"url={self.url!r}, model={self.model!r}" if self.url else f"generate={self.generate!r}"
        return f"LLMJudge({backend})"


def _score_or_error(reply: str) -> float | Exception:
    try:
        return parse_score(reply)
    except ValueError as e:
        return e
