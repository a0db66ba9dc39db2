"""Running episodes: one by hand (`EpisodeHandle.step`), or all of a step's episodes batched, turn by turn.

The batched loop (`EpisodeRunner.rollout`): every episode waiting for its next turn is sampled in one sampler
call; episodes whose turn called tools hand the calls (all of the turn's, which run at once) to the environment
worker and wait; whatever tools have finished are appended and those episodes join the next sampler call. A slow
tool holds up its own episode only.
An episode ends on EOS, at max_turns, at max_new_tokens, when the context is full, when a game says done;
its environment is scored and closed the moment it ends, and closed (unscored) if the rollout itself fails.

Each sampler call samples every row with its own seed (from the rollout's seed, the episode's row in the rollout
and the turn), so an episode's tokens depend neither on which other episodes share the call nor on the episodes
run before (an evaluation, `s.episode()`, a restart from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable

from rlbench.agents.env import pick
from rlbench.agents.episode import SAMPLED, Episode, Turn, hash62, to_batch
from rlbench.agents.parsers import assistant_message, tool_messages
from rlbench.agents.render import Renderer, TemplateReport, chat_messages, check_template
from rlbench.batch import Batch
from rlbench.models.vision import IMAGE_MARK, IMAGE_TOKENS, Vision, content_of

Sample = Callable[[list[list[int]], list[int], int, bool, list[dict] | None], Batch]
"""`sample(contexts, seeds, max_new_tokens, greedy, images)`: one completion per context (a seed each), as the
Sampler protocol's Batch (`response_ids`, `response_mask`, `sampler_logp`, `finished`), stopping at EOS or the
parser's stop tokens; `images`: per context, its pictures' pixels and grids (None when no context has one)."""

POLL_S = 0.05
"""How long the loop waits for tools when no episode can be sampled."""


class EpisodeRunner:
    """Drives episodes: the sampler (`sample`), the chat template with each environment's tools (`renderers`: by
    the value of the examples' `route` field, {None: renderer} for one environment), the tool-call `parser` and the
    environments (`envs`: an `EnvPool` or a handle to one on Ray)."""

    def __init__(self, sample: Sample, renderers: dict[str | None, Renderer], parser, envs, tokenizer, *,
                 max_turns: int, max_new_tokens: int, max_context: int, game: bool = False, route: str | None = None):
        self.sample_fn, self.renderers, self.parser, self.envs = sample, renderers, parser, envs
        self.route = route
        self.tokenizer, self.game = tokenizer, game
        self.max_turns, self.max_new_tokens, self.max_context = max_turns, max_new_tokens, max_context
        self.version = 0
        """Weights version recorded on sampled tokens (the session sets it: updates the sampler has seen)."""
        self.seed = 0
        """Seed of the next sampler calls (the session sets it per rollout)."""
        self._next_key = 0
        self._results: dict[int, object] = {}  # finished tool work not yet taken by its episode

    # ------------------------------------------------------------------------------ episodes
    def start(self, examples: list[dict], *, greedy: bool = False) -> list[Episode]:
        """New episodes, one per example: environments reset, first contexts rendered (with the tools of each
        example's environment); `greedy` turns sample the most likely token. ValueError, before any environment
        starts, for an example whose `route` field names no environment."""
        renderers = [self.renderer_of(example) for example in examples]
        keys = list(range(self._next_key, self._next_key + len(examples)))
        self._next_key += len(examples)
        episodes = []
        for row, (key, example, renderer, (messages, error)) in enumerate(
                zip(keys, examples, renderers, self.envs.open(keys, examples))):
            seed = hash62(f"{self.seed}/{row}")
            if error is None:
                try:
                    ids, pixels = renderer.prompt(messages, example.get("images") or [])
                except (OSError, TypeError, ValueError) as bad:  # its pictures: unreadable, or marks that do not pair up
                    error = f"its first context cannot be encoded: {bad}"
                    self.envs.close([key])
            if error is not None:  # the prompt, if the example has a usable one, keeps the row trainable-shaped
                ids = self._prompt_ids(renderer, example)
                episodes.append(Episode(key, example, None, ids, error=error, greedy=greedy, seed=seed))
                continue
            episode = Episode(key, example, messages, ids, greedy=greedy, seed=seed)
            episode.add_images(example.get("images") or [], pixels)
            episode.states.append(renderer.render(messages, generation_prompt=True))
            if len(ids) >= self.max_context:
                episode.end("context_full")
            episodes.append(episode)
        return episodes

    def renderer_of(self, example: dict) -> Renderer:
        """The chat template with the tools of the example's environment."""
        return pick(self.renderers, self.route, example)

    def _prompt_ids(self, renderer: Renderer, example) -> list[int]:
        """The tokens of the example's prompt as text (its pictures left out), or EOS alone when it has none that
        renders."""
        try:
            return renderer.encode(renderer.render(chat_messages(example["prompt"]), generation_prompt=True))
        except (KeyError, TypeError, ValueError):
            return [self.tokenizer.eos_token_id]

    def sample(self, episodes: list[Episode]) -> None:
        """Sample the next assistant turn of each episode (one sampler call)."""
        rooms = [self.max_context - len(ep.context) for ep in episodes]
        for ep, room in zip(episodes, rooms):
            if room <= 0:
                ep.end("context_full")
        live = [(ep, room) for ep, room in zip(episodes, rooms) if room > 0]
        if not live:
            return
        images = [ep.image_inputs for ep, _ in live]
        out = self.sample_fn([ep.context for ep, _ in live], [self._seed(ep) for ep, _ in live],
                             min(self.max_new_tokens, max(room for _, room in live)), live[0][0].greedy,
                             images if any(images) else None)
        lengths, finished = out["response_mask"].sum(-1).tolist(), out["finished"].tolist()
        for (ep, room), ids, logps, n, done in zip(live, out["response_ids"].tolist(), out["sampler_logp"].tolist(),
                                                   lengths, finished):
            cut = n > room
            n = min(n, room)
            ids, logps = ids[:n], logps[:n]
            self._record_turn(ep, ids, logps, done and not cut, cut)

    def _record_turn(self, ep: Episode, ids: list[int], logps: list[float], finished: bool, cut: bool) -> None:
        """Append a sampled turn and decide what follows it."""
        eos = self.tokenizer.eos_token_id
        text = self.tokenizer.decode(ids[:-1] if finished and ids and ids[-1] == eos else ids)
        calls, errors = self.parser.parse(text) if not self.game else ([], [])
        reason = ("context_full" if cut else "max_tokens" if not finished else "tool_call" if calls or errors
                  else "eos")
        ep.turns.append(Turn(text=text, stop_reason=reason, calls=calls, errors=list(errors), unreadable=list(errors),
                             attempts=len(calls) + len(errors)))
        ep.append(ids, [SAMPLED] * len(ids), logps, self.version)
        ep.messages.append({"role": "assistant", "content": text} if self.game  # the turn as its template takes it
                           else assistant_message(self.parser, text, calls))
        if reason == "tool_call" or (self.game and reason == "eos"):
            if len(ep.turns) >= self.max_turns:
                ep.end("max_turns")
            else:
                ep.pending_tool_calls, ep.awaiting_env = calls, True
        else:
            ep.end(reason)

    def submit(self, ep: Episode) -> None:
        """Hand the episode's pending calls (a game: its last turn) to the environment worker."""
        if self.game:
            self.envs.submit(ep.key, action=ep.turns[-1].text)
        else:
            self.envs.submit(ep.key, calls=list(ep.pending_tool_calls))
        ep.pending_tool_calls, ep.awaiting_env, ep.waiting = [], False, True

    def collect(self, wait_s: float) -> list[int]:
        """Take finished tool work from the environment worker; the keys that now have results."""
        self._results.update(self.envs.poll(wait_s))
        return list(self._results)

    def apply(self, ep: Episode, results) -> None:
        """Append what the tools (or the game) returned, then the next generation prompt."""
        ep.waiting = False
        turn = ep.turns[-1]
        if self.game:
            observation, reward, done, error = results
            turn.reward = reward
            if error is not None:  # the game failed: the episode ends there, the reason on the turn and the episode
                turn.errors.append(error)
                ep.error = ep.reward_error = error
                ep.end("error")
                return
            messages = [] if done else [{"role": "user", "content": observation}]
            if done:
                ep.end("env_done")
                return
        renderer = self.renderer_of(ep.example)
        pictures = []
        if not self.game:
            contents, errors = [], []
            for message, error in [*results, *((f"error: {e}", None) for e in turn.unreadable)]:
                text, images, problem = _content(message, renderer.vision)
                contents.append(text)
                pictures.append(images)
                errors.append(problem or error)
            turn.errors[:0] = [e for e in errors[: len(results)] if e is not None]  # (the unreadable's are there)
            messages = tool_messages(self.parser, turn.calls, contents)
        turn.results = [m["content"] for m in messages]
        sampled = self.tokenizer.decode(ep.ids[len(ep.ids) - _sampled_run(ep):])
        try:
            ids, kinds, pixels = renderer.continuation(sampled, messages, ep.messages[-1], pictures)
        except ValueError as error:  # text that a vision-language model's tokenizer reads as image markup
            ep.error = ep.reward_error = f"the context cannot be continued after turn {len(ep.turns) - 1}: {error}"
            ep.end("error")
            return
        if len(ep.context) + len(ids) >= self.max_context:
            ep.end("context_full")
            return
        ep.append(ids, kinds, None, self.version)
        ep.add_images([p for images in pictures for p in images], pixels)
        ep.messages += messages
        ep.states.append("\n".join(m["content"] for m in messages))

    def finish(self, ep: Episode) -> float:
        """Score a finished episode with its environment (which is then closed); its score."""
        if not ep.done:
            ep.end("max_turns" if ep.turns else "error")
        if ep.score is None:
            score, components, turn_rewards, error = self.envs.score(ep.key, ep)
            ep.score, ep.components, ep.turn_rewards = score, components, turn_rewards
            ep.reward_error = ep.reward_error or error
        return ep.score

    def check_template(self, example: dict) -> TemplateReport | None:
        """`check_template` on a conversation of this task: the example's first turn, an answer, a tool result
        (a game: an observation) and another answer (None if the environment fails to start). A template that
        cannot render that conversation (gpt-oss names a tool result after the call before it, and this one has
        none) gives a report that says so: the session warns and goes on, its episodes render real calls."""
        [ep] = self.start([example])
        self.envs.close([ep.key])
        if ep.error is not None:
            return None
        role = "user" if self.game else "tool"
        messages = ep.messages + [{"role": "assistant", "content": "1"}, {"role": role, "content": "2"},
                                  {"role": "assistant", "content": "3"}]
        try:
            return check_template(self.tokenizer, messages, self.renderer_of(example).tools)
        except ValueError as error:
            return TemplateReport(error=str(error))

    # -------------------------------------------------------------------------------- by hand
    def step(self, ep: Episode) -> None:
        """`EpisodeHandle.step`: a sampled turn, or the pending tools' results appended."""
        if ep.done:
            raise RuntimeError(f"the episode has ended ({ep.stop_reason}); ep.reward() scores it")
        if ep.pending_tool_results is not None:
            results, ep.pending_tool_results = ep.pending_tool_results, None
            self.apply(ep, [(r, None) for r in results] if not self.game else (results[0], 0.0, False, None))
        elif ep.awaiting_env:
            self.apply(ep, self._run_now(ep))
        else:
            self.sample([ep])
        if ep.done:
            self.finish(ep)

    def run_tools(self, ep: Episode) -> list[str]:
        """Run the pending calls now; their messages wait in `ep.pending_tool_results` for the next step."""
        if not ep.awaiting_env:
            raise RuntimeError("no tool calls are pending: step() samples the next turn")
        results = self._run_now(ep)
        ep.pending_tool_results = [results[0]] if self.game else [message for message, _ in results]
        ep.turns[-1].errors[:0] = [] if self.game else [error for _, error in results if error is not None]
        return ep.pending_tool_results

    def _run_now(self, ep: Episode):
        self.submit(ep)
        while ep.key not in self.collect(POLL_S):
            pass
        return self._results.pop(ep.key)

    # ---------------------------------------------------------------------------------- batched
    def rollout(self, examples: list[dict], group_ids: list[int], *, greedy: bool = False) -> Batch:
        """Run one episode per example to its end, all turns batched; the Batch of the scored episodes."""
        episodes = self.start(examples, greedy=greedy)
        try:
            while True:
                ready = [ep for ep in episodes if not (ep.done or ep.waiting)]
                if ready:
                    self.sample(ready)
                    for ep in ready:
                        if ep.done:
                            self.finish(ep)
                        else:
                            self.submit(ep)
                waiting = {ep.key: ep for ep in episodes if ep.waiting}
                if not waiting:
                    break
                for key in self.collect(0.0 if ready else POLL_S):
                    if key in waiting:
                        ep = waiting[key]
                        self.apply(ep, self._results.pop(key))
                        if ep.done:
                            self.finish(ep)
            for ep in episodes:
                self.finish(ep)  # those that ended at the start (a failed reset, a prompt over the context)
        except BaseException:
            self.envs.close([ep.key for ep in episodes])
            raise
        completions = [self.tokenizer.decode(ep.ids) for ep in episodes]
        return to_batch(episodes, group_ids, completions, pad_token_id=self.tokenizer.pad_token_id)

    def _seed(self, ep: Episode) -> int:
        return hash62(f"{ep.seed}/{len(ep.turns)}")


class EpisodeHandle:
    """An episode stepped by hand, what `s.episode(example)` returns: `step()` samples the next turn (to its end, or to
    its first call with a parser that stops there) or runs the pending calls and appends their results;
    `run_tools()` runs them without appending (edit `pending_tool_results`, then `step()`); `reward()` ends and
    scores it. Everything else is its `record`'s
    (an `Episode`: `ep.turns`, `ep.pending_tool_calls`, `ep.final_text`, ...); `show()`, `stretches()` and `to_pandas()` decode
    with the session's tokenizer."""

    def __init__(self, record: Episode, runner: EpisodeRunner):
        self.record, self.runner = record, runner

    def step(self) -> EpisodeHandle:
        self.runner.step(self.record)
        return self

    def run_tools(self) -> list[str]:
        return self.runner.run_tools(self.record)

    def reward(self) -> float:
        return self.runner.finish(self.record)

    @property
    def pending_tool_calls(self) -> list:
        """The calls of the last turn, not yet run: edit them before the next `step()`."""
        return self.record.pending_tool_calls

    @pending_tool_calls.setter
    def pending_tool_calls(self, calls: list) -> None:
        self.record.pending_tool_calls = calls

    @property
    def pending_tool_results(self) -> list[str] | None:
        """Results of `run_tools()`, not yet appended: edit them before the next `step()`."""
        return self.record.pending_tool_results

    @pending_tool_results.setter
    def pending_tool_results(self, results: list[str] | None) -> None:
        self.record.pending_tool_results = results

    def to_pandas(self):
        return self.record.to_pandas(self.runner.tokenizer)

    def stretches(self):
        return self.record.stretches(self.runner.tokenizer)

    def show(self):
        return self.record.show(self.runner.tokenizer)

    def _repr_html_(self) -> str:
        return self.record._repr_html_(self.runner.tokenizer)

    def __getattr__(self, name: str):  # reading the record's fields and views: ep.turns, ep.done, ep.messages
        if name in ("record", "runner"):  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.record, name)

    def __repr__(self) -> str:
        return repr(self.record)


def _content(value, vision: Vision | None) -> tuple[str, list, str | None]:
    """(text, pictures, problem) of what a tool returned (`rl.models.vision.content_of`: a text, a PIL image, or a
    list of both); a result the model cannot be given becomes an error message, its reason the problem: pictures
    for a text-only model, a text that writes `<image>` marks of its own beside pictures, and for a vision-language
    model image markup tokens typed as text (they would stand for pictures the tool did not return)."""
    text, pictures = content_of(value)
    if pictures and vision is None:
        problem = f"the tool returned {len(pictures)} picture(s) and the model is text-only (no vision tower)"
    elif pictures and text.count(IMAGE_MARK) != len(pictures):
        problem = f"the tool's text writes the image mark itself beside its {len(pictures)} picture(s)"
    elif vision is not None and any(token in text for token in IMAGE_TOKENS):
        problem = "the tool's text holds this model's image markup tokens as text"
    else:
        return text, pictures, None
    return f"error: {problem}", [], problem


def _sampled_run(ep: Episode) -> int:
    """How many tokens at the end of the response were sampled (the last turn's)."""
    n = 0
    for kind in reversed(ep.kinds):
        if kind != SAMPLED:
            break
        n += 1
    return n

