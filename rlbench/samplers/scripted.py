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

With `then=` a real sampler, `respond` may return None: that context's completion is the real sampler's (its
tokens and log-probs, with the context's pictures). A script then writes the turns a model cannot yet (the first
tool call of a model never taught to call tools) and leaves the rest to the model:

    sampler = ScriptedSampler(tokenizer, lambda context: None if "<tool_response>" in context else call,
                              then=rl.samplers.HFSampler.from_pretrained(model_dir))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from rlbench.batch import Batch
from rlbench.samplers.base import SamplingParams


class ScriptedSampler:
    """The Sampler protocol over a function of the context's text (see the module docstring)."""

    def __init__(self, tokenizer, respond: Callable[[str], str | list[int] | None], *, eos: bool = False,
                 then=None):
        self.tokenizer, self.respond, self.eos, self.then = tokenizer, respond, eos, then
        """`eos`: a completion with no stop token in it ends with the tokenizer's EOS (a script writes its final
        answers as text, without the EOS id; a tool call still ends at its stop token). `then`: the sampler of the
        contexts `respond` leaves (returns None for)."""
        self.calls: list[list[str]] = []
        """The contexts of every `generate` call, as text (what the sampler was asked to continue)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, images=None) -> Batch:
        """The Sampler protocol's `generate`; a script reads the contexts' text only (`images`, their pictures'
        pixels, go to the `then` sampler with the contexts it draws)."""
        stops = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        contexts = [self.tokenizer.decode(list(ids)) for ids in prompt_ids]
        self.calls.append(contexts)
        scripted = [self.respond(context) for context in contexts]
        left = [i for i, out in enumerate(scripted) if out is None]
        if left and self.then is None:
            raise ValueError(f"the script gave no completion (None) for context {left[0]} and the sampler has no "
                             f"then= sampler to draw it: {contexts[left[0]][-80:]!r}")
        drawn = iter(self._drawn(prompt_ids, params, images, left))
        rows = []  # (ids, log-probs) per row
        for out in scripted:
            if out is None:
                rows += next(drawn)
                continue
            ids = list(out) if not isinstance(out, str) else self.tokenizer.encode(out, add_special_tokens=False)
            if self.eos and not stops.intersection(ids):
                ids.append(self.tokenizer.eos_token_id)
            ids = ids[: min(next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids)), params.max_new_tokens)]
            rows += [(ids, [-(k + 1) / 100 for k in range(len(ids))])] * params.n
        T = max([len(ids) for ids, _ in rows] + [1])
        ids_B_T = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(rows), T), dtype=torch.long)
        logp_B_T = torch.zeros((len(rows), T), dtype=torch.float32)
        for i, (ids, logps) in enumerate(rows):
            ids_B_T[i, : len(ids)], mask_B_T[i, : len(ids)] = torch.tensor(ids, dtype=torch.long), 1
            logp_B_T[i, : len(ids)] = torch.tensor(logps, dtype=torch.float32)
        finished_B = torch.tensor([bool(ids) and ids[-1] in stops for ids, _ in rows], dtype=torch.bool)
        return Batch({"response_ids": ids_B_T, "response_mask": mask_B_T, "sampler_logp": logp_B_T,
                      "finished": finished_B})

    def _drawn(self, prompt_ids, params: SamplingParams, images, left: list[int]) -> list[list[tuple]]:
        """The `then` sampler's completions of the contexts `left` (one call, the rows' own seeds and pictures):
        per context, its `params.n` rows as (ids, log-probs)."""
        if not left:
            return []
        params = replace(params, seeds=params.seeds and tuple(params.seeds[i] for i in left))
        picked = [images[i] for i in left] if images is not None else None
        out = self.then.generate([prompt_ids[i] for i in left], params,
                                 **({"images": picked} if picked is not None and any(picked) else {}))
        lengths = out["response_mask"].sum(-1).tolist()
        rows = [(ids[:n], logps[:n]) for ids, logps, n in zip(out["response_ids"].tolist(),
                                                              out["sampler_logp"].tolist(), lengths)]
        return [rows[k * params.n : (k + 1) * params.n] for k in range(len(left))]

    def load_weights(self, state_dict) -> None:
        """Scripted turns do not depend on weights; the `then` sampler takes them."""
        if self.then is not None:
            self.then.load_weights(state_dict)
