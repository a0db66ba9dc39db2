"""A sampler that replays scripted turns: environments, parsing, masks and rewards, testable without a model.

    tokenizer = rl.models.load_tokenizer(rl.models.resolve("tiny-tools"))   # a built-in model's tokenizer
    sampler = ScriptedSampler(tokenizer, lambda context: "12" if "R:" in context else
                              '<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>', eos=True)
    s = rl.Session(model="tiny-tools", task=task, sampler=sampler, cluster="inline", max_new_tokens=64)

`respond(context_text)` gives the next completion of a context (text, or token ids) from the text the sampler
was handed; what it returns is cut at the first stop token (EOS or the call's `stop_token_ids`) or at
max_new_tokens, like a real sampler's; with `eos=True` one that has no stop token ends with EOS (a final answer
written as text). Token i of a completion gets log-prob -(i + 1) / 100, so a test can
tell where each sampled token went.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlbench.batch import Batch
from rlbench.samplers.base import SamplingParams


class ScriptedSampler:
    """The Sampler protocol over a function of the context's text (see the module docstring)."""

    def __init__(self, tokenizer, respond: Callable[[str], str | list[int]], *, eos: bool = False):
        self.tokenizer, self.respond, self.eos = tokenizer, respond, eos
        """`eos`: a completion with no stop token in it ends with the tokenizer's EOS (a script writes its final
        answers as text, without the EOS id; a tool call still ends at its stop token)."""
        self.calls: list[list[str]] = []
        """The contexts of every `generate` call, as text (what the sampler was asked to continue)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Batch:
        stops = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        contexts = [self.tokenizer.decode(list(ids)) for ids in prompt_ids]
        self.calls.append(contexts)
        rows = []
        for context in contexts:
            out = self.respond(context)
            ids = list(out) if not isinstance(out, str) else self.tokenizer.encode(out, add_special_tokens=False)
            if self.eos and not stops.intersection(ids):
                ids.append(self.tokenizer.eos_token_id)
            end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
            rows += [ids[: min(end, params.max_new_tokens)]] * params.n
        T = max([len(r) for r in rows] + [1])
        ids_B_T = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(rows), T), dtype=torch.long)
        for i, r in enumerate(rows):
            ids_B_T[i, : len(r)], mask_B_T[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        logp_B_T = -(torch.arange(T, dtype=torch.float32) + 1)[None] / 100 * mask_B_T
        finished_B = torch.tensor([bool(r) and r[-1] in stops for r in rows], dtype=torch.bool)
        return Batch({"response_ids": ids_B_T, "response_mask": mask_B_T, "sampler_logp": logp_B_T,
                      "finished": finished_B})

    def load_weights(self, state_dict) -> None:
        """Scripted turns do not depend on weights."""
