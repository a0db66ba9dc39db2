"""An episode: a multi-turn conversation kept as the exact tokens the sampler saw, and its rows in a Batch.

Every token after the first prompt is kept with what made it (`kind`: sampled by the policy, written by the
chat template, or a tool's output), the sampler's log-prob (sampled tokens only), the assistant turn it belongs
to, and the weights version that sampled it. Each turn records why it stopped:

    "eos"           the model ended its turn (the episode ends)
    "tool_call"     the turn made tool calls (or tried to: malformed calls count too); tools run next
    "max_tokens"    the turn hit max_new_tokens (the episode ends)
    "context_full"  no room left in the model's context (the episode ends)

and the episode why it ended: one of those, or "max_turns" (the last allowed turn called a tool), "env_done"
(a game said done) or "error" (the environment failed to start, its first context or a later one could not be
encoded, or a game's step failed: `reward_error` says why).

In a Batch an episode is one row (see `to_batch`): `response_mask` covers every token after the prompt (the
context the trainer runs over), `loss_mask` only the sampled ones (what losses, reductions and estimators use).

With a vision-language model an episode also keeps its pictures (its example's `images`, then those its tools
returned) in the order their image tokens (kind "image") come in its context, and their pixels: each turn's sampler
call and the trainer's forward take them.
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass, field

import torch

from rlbench.agents.parsers import ToolCall
from rlbench.agents.render import KINDS
from rlbench.batch import Batch, left_pad, thumbnails
from rlbench.models import readable_decode
from rlbench.models.vision import joined

SAMPLED = KINDS.index("sampled")
IMAGE = KINDS.index("image")
ENDS = ("eos", "tool_call", "max_tokens", "context_full", "max_turns", "env_done", "error")
"""Every stop reason of a turn or an episode."""


@dataclass
class Turn:
    """One assistant turn: what it sampled, why it stopped, its calls and what came back."""

    text: str
    """The sampled text (without a final EOS token)."""
    stop_reason: str
    calls: list[ToolCall] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    """The tool messages (or the game's observation) appended after it."""
    errors: list[str] = field(default_factory=list)
    """What went wrong with its calls: unknown tool, bad arguments, raised, timed out, unreadable."""
    unreadable: list[str] = field(default_factory=list)
    """The parser's messages about calls it could not read (also in `errors`)."""
    attempts: int = 0
    """Calls it made or tried to make (unreadable ones count)."""
    reward: float | None = None
    """A game's step reward for this turn (per-turn rewards of a tool environment come from `reward`)."""


class Episode:
    """One episode's record: its conversation, tokens and score. Plain data (it pickles, and a Batch keeps it in its
    "episode" column); `s.episode(example)` returns an `EpisodeHandle` that steps one by hand.
    """

    def __init__(self, key: int, example: dict, messages: list[dict] | None, prompt_ids: list[int],
                 error: str | None = None, greedy: bool = False, seed: int = 0):
        self.key, self.example, self.prompt_ids, self.greedy = key, example, list(prompt_ids), greedy
        self.seed = seed
        """Seeds its turns' sampling, with the turn's number: from the rollout's seed and its row in the rollout,
        so it depends on neither the episodes run before it in this process nor the others of its call."""
        self.messages: list[dict] = list(messages or [])
        """The conversation as messages: each assistant message as the parser reads its sampled text (content and
        `tool_calls`; a game's: the text), the tool results after it named after its calls."""
        self.ids: list[int] = []
        self.kinds: list[int] = []
        self.logps: list[float] = []
        self.turn_of: list[int] = []
        self.versions: list[int] = []
        self.turns: list[Turn] = []
        self.states: list[str] = []
        """What the policy saw before each turn (the last observation; the prompt before the first)."""
        self.images: list = []
        """Its pictures (PIL images; paths or records as its example gives them) in context order."""
        self.pixels: list[dict] = []
        """Their pixels and grids, a dict per stretch of context that brought pictures (`Vision.encode`'s); left out
        when an episode is pickled (a reward reads `images`; a Batch keeps the pixels in its `image_inputs`)."""
        self.pending_tool_calls: list[ToolCall] = []
        """The calls of the last turn, not yet run: edit them before the next `step()`."""
        self.pending_tool_results: list[str] | None = None
        """Results of `run_tools()`, not yet appended: edit them before the next `step()`."""
        self.awaiting_env = False
        """The last turn called tools (or acted in a game) that have not run yet."""
        self.waiting = False
        """Its tools are running."""
        self.stop_reason: str | None = "error" if error else None
        self.error = error
        self.score: float | None = None
        self.components: dict[str, float] = {}
        self.turn_rewards: list[float] = []
        self.reward_error: str | None = error

    # ------------------------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def context(self) -> list[int]:
        """Every token so far: the prompt, then the response."""
        return self.prompt_ids + self.ids

    @property
    def final_text(self) -> str:
        """The text of the last assistant turn (what an answer is read from)."""
        return self.turns[-1].text if self.turns else ""

    @property
    def tool_calls(self) -> int:
        """Calls the model made or tried to make (malformed ones too)."""
        return sum(t.attempts for t in self.turns)

    @property
    def tool_errors(self) -> int:
        """Calls that did not give a result: unreadable, unknown tool, bad arguments, raised, timed out."""
        return sum(len(t.errors) for t in self.turns)

    def append(self, ids: list[int], kinds: list[int], logps: list[float] | None, version: int) -> None:
        """Add tokens to the response (sampled ones with their log-probs), in the current turn."""
        turn = max(len(self.turns) - 1, 0)
        self.ids += ids
        self.kinds += kinds
        self.logps += logps if logps is not None else [0.0] * len(ids)
        self.turn_of += [turn] * len(ids)
        self.versions += [version] * len(ids)

    def add_images(self, images: list, pixels: dict) -> None:
        """Keep pictures that entered the context, and their pixels ({} for none)."""
        self.images += images
        self.pixels += [pixels] if pixels else []

    @property
    def image_inputs(self) -> dict:
        """Its pictures' pixels and grids as one dict, in context order ({} without): what a sampler and the
        trainer's forward take for its row."""
        return joined(self.pixels)

    def _picture_starts(self) -> list[int]:
        """Where each picture's tokens start in the response (a run of image tokens starts again at its first
        token's id, `<|vision_start|>`)."""
        starts = []
        for i, (t, k) in enumerate(zip(self.ids, self.kinds)):
            if k == IMAGE and (i == 0 or self.kinds[i - 1] != IMAGE or t == self.ids[starts[-1]]):
                starts.append(i)
        return starts

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "pixels"} | {"pixels": []}

    def end(self, reason: str) -> None:
        assert reason in ENDS, reason
        self.stop_reason = reason
        self.pending_tool_calls, self.awaiting_env = [], False

    # ------------------------------------------------------------------------------------ views
    def to_pandas(self, tokenizer=None):
        """One row per response token: position, id, text (with a tokenizer), kind, turn, trainable, the
        sampler's log-prob (sampled tokens), weights version."""
        import pandas as pd

        return pd.DataFrame({
            "position": range(len(self.prompt_ids), len(self.prompt_ids) + len(self.ids)), "token_id": self.ids,
            **({"text": [readable_decode(tokenizer, [t]) for t in self.ids]} if tokenizer is not None else {}),
            "kind": [KINDS[k] for k in self.kinds], "turn": self.turn_of, "trainable": [k == SAMPLED for k in self.kinds],
            "sampler_logp": [lp if k == SAMPLED else None for lp, k in zip(self.logps, self.kinds)],
            "version": self.versions})

    def stretches(self, tokenizer=None):
        """One row per stretch of the response, consecutive tokens of one turn and one kind (what the model sampled,
        a tool's output, the template's tokens): its turn, kind, first position, token count, text (with a
        tokenizer), whether it is trained on, and for sampled stretches the sampler's log-prob summed over its tokens
        and per token; the weights versions that drew it. `to_pandas` has one row per token."""
        import pandas as pd

        rows, start = [], 0
        for end in range(1, len(self.ids) + 1):
            if end < len(self.ids) and (self.turn_of[end], self.kinds[end]) == (self.turn_of[start], self.kinds[start]):
                continue
            sampled = self.kinds[start] == SAMPLED
            logp = sum(self.logps[start:end]) if sampled else None
            rows.append({"turn": self.turn_of[start], "kind": KINDS[self.kinds[start]],
                         "position": len(self.prompt_ids) + start, "tokens": end - start,
                         **({"text": readable_decode(tokenizer, self.ids[start:end])} if tokenizer is not None else {}),
                         "trainable": sampled, "sampler_logp": logp,
                         "logp_per_token": None if logp is None else logp / (end - start),
                         "versions": sorted(set(self.versions[start:end]))})
            start = end
        return pd.DataFrame(rows)

    def show(self, tokenizer=None):
        """The episode as HTML: the prompt, then each token coloured by kind (sampled / tool / template; a picture as
        its thumbnail), its log-prob and turn on hover; the turns' stop reasons and errors below."""
        from IPython.display import HTML

        return HTML(self._repr_html_(tokenizer))

    def _repr_html_(self, tokenizer=None) -> str:
        if tokenizer is None:
            return f"<pre>{html.escape(repr(self))}</pre>"
        colours = {"sampled": "#d8f0d8", "tool": "#f6e3c4", "template": "#e4e4e4", "image": "#dbe6f6"}
        starts = self._picture_starts()
        in_prompt = len(self.images) - len(starts)
        pictures = dict(zip(starts, self.images[in_prompt:]))
        spans = []
        for i, (t, k, lp, turn) in enumerate(zip(self.ids, self.kinds, self.logps, self.turn_of)):
            kind = KINDS[k]
            if k == IMAGE:  # a picture's tokens: its thumbnail, once
                if i in pictures:
                    count = next((j for j in range(i + 1, len(self.ids)) if self.kinds[j] != IMAGE or j in pictures),
                                 len(self.ids)) - i
                    spans.append(f'<span title="image, turn {turn}, {count} tokens" style="background:'
                                 f'{colours[kind]}">{thumbnails([pictures[i]]) or "[image]"}</span>')
                continue
            tip = f"{kind}, turn {turn}" + (f", logp {lp:.3f}" if k == SAMPLED else "")
            spans.append(f'<span title="{tip}" style="background:{colours[kind]}">'
                         f"{html.escape(readable_decode(tokenizer, [t]))}</span>")
        turns = "".join(f"<li>turn {i}: {t.stop_reason}" + (f", {len(t.calls)} call(s)" if t.calls else "") +
                        "".join(f"; <i>{html.escape(e)}</i>" for e in t.errors) + "</li>"
                        for i, t in enumerate(self.turns))
        legend = " ".join(f'<span style="background:{c}">{k}</span>' for k, c in colours.items())
        shown = thumbnails(self.images[:in_prompt]) or ""  # the prompt's pictures, then its text
        return (f"<div>{shown}<pre style='white-space:pre-wrap'>{html.escape(readable_decode(tokenizer, self.prompt_ids))}"
                f"{''.join(spans)}</pre><p>{legend} · ended: {self.stop_reason or 'running'}"
                f"{'' if self.score is None else f' · score {self.score:.3g}'}</p><ul>{turns}</ul></div>")

    def __repr__(self) -> str:
        state = self.stop_reason or ("tools pending" if self.awaiting_env else "running")
        return (f"Episode({len(self.turns)} turns, {len(self.ids)} response tokens "
                f"({sum(k == SAMPLED for k in self.kinds)} sampled), {self.tool_calls} tool calls, "
                f"{self.tool_errors} errors, {state}" + ("" if self.score is None else f", score {self.score:.3g}") + ")")


def hash62(text: str) -> int:
    """A 62-bit hash of a text: the id of what the policy saw before a turn (GiGPO groups the turns that saw the
    same), an episode's seeds."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def to_batch(episodes: list[Episode], group_ids: list[int], completions: list[str], *, pad_token_id: int) -> Batch:
    """The rows of finished, scored episodes (the layout is in the module docstring and `rl.agents`);
    `completions`: each episode's response as text. With pictures, each row's (`images`, shown as thumbnails) and
    their pixels (`image_inputs`: the prompt's and the tools', in context order)."""
    B, T = len(episodes), max([len(ep.ids) for ep in episodes] + [1])  # a padding column when no episode started
    N = max([len(ep.turns) for ep in episodes] + [1])

    def padded(rows: list[list], fill, dtype) -> torch.Tensor:
        return torch.tensor([list(r) + [fill] * (T - len(r)) for r in rows], dtype=dtype).view(B, T)

    # an episode that sampled nothing (its first observation did not fit, or it failed to start) trains nothing:
    # its row keeps one prompt token, so that no forward runs over a prompt longer than the model's context
    prompt_ids, prompt_mask = left_pad([ep.prompt_ids if ep.ids else ep.prompt_ids[-1:] for ep in episodes],
                                       pad_token_id)
    kinds = padded([ep.kinds for ep in episodes], -1, torch.long)
    components = sorted({k for ep in episodes for k in ep.components})
    return Batch({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "response_ids": padded([ep.ids for ep in episodes], pad_token_id, torch.long),
        "response_mask": (kinds >= 0).long(), "loss_mask": (kinds == SAMPLED).long(), "token_kind": kinds,
        "sampler_logp": padded([[lp if k == SAMPLED else 0.0 for lp, k in zip(ep.logps, ep.kinds)]
                                for ep in episodes], 0.0, torch.float32),
        "turn": padded([ep.turn_of for ep in episodes], -1, torch.long),
        "version": padded([ep.versions for ep in episodes], -1, torch.long),
        "finished": torch.tensor([ep.stop_reason in ("eos", "env_done") for ep in episodes], dtype=torch.bool),
        "turns": torch.tensor([len(ep.turns) for ep in episodes], dtype=torch.long),
        "tool_calls": torch.tensor([ep.tool_calls for ep in episodes], dtype=torch.long),
        "tool_errors": torch.tensor([ep.tool_errors for ep in episodes], dtype=torch.long),
        "score": torch.tensor([ep.score or 0.0 for ep in episodes], dtype=torch.float32),
        **{k: torch.tensor([ep.components.get(k, 0.0) for ep in episodes], dtype=torch.float32) for k in components},
        "turn_rewards": torch.tensor([ep.turn_rewards[:N] + [0.0] * (N - len(ep.turn_rewards[:N])) for ep in episodes],
                                     dtype=torch.float32).view(B, N),
        "turn_state": torch.tensor([[hash62(s) for s in ep.states[:N]] + [-1] * (N - len(ep.states[:N]))
                                    for ep in episodes], dtype=torch.long).view(B, N),
        "group_ids": torch.tensor(group_ids, dtype=torch.long),
    }, {
        "prompt": [ep.example.get("prompt", ep.messages[:1]) for ep in episodes],
        "completion": list(completions),
        "example": [ep.example for ep in episodes],
        "stop_reason": [ep.stop_reason for ep in episodes],
        "reward_error": [ep.reward_error for ep in episodes],
        "episode": list(episodes),
        **({"images": [list(ep.images) for ep in episodes], "image_inputs": [ep.image_inputs for ep in episodes]}
           if any(ep.pixels for ep in episodes) else {}),
    }, {"reward_components": components, "agentic": True})
