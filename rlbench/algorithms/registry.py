"""Names → parts, and `Algorithm`: the record that bundles the parts an RL step needs.

Four registries: advantage estimators, policy losses, algorithms (presets), rollout corrections. An advantage, a
loss or a correction may record `verl=`: verl 0.9.1's name for the same thing (its registry name, or the config
that selects it), which `describe` prints and docs/algorithms.md lists. A name is taken once: registering it
again with the same object is a no-op, with a different one a `ValueError`. One
exception keeps notebooks re-runnable: a function defined in `__main__` (a notebook cell or a script) replaces
an earlier `__main__` function of the same `__qualname__` under the same name, and an algorithm or a
correction registered from `__main__` replaces one registered from `__main__` under the same name.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from .core import (KL_KINDS, REDUCTIONS, REVERSE_KL_KINDS, AdaptiveKL, aggregate, forward_kl_topk, kl, masked_mean,
                   reverse_kl_advantages)
from .correction import RolloutCorrection

TURN_DATA = ("turn_B_T", "turn_rewards_B_N", "turns_B", "turn_state_B_N")
"""The advantage data only an agentic (multi-turn) task has."""
ADVANTAGE_DATA = ("group_ids", "values_B_T", "baselines_B", "old_logp_B_T", "reward_components_B_K", "sum_pi2_B_T",
                  "is_weights_B_T", "teacher_logp_B_T", *TURN_DATA)
"""Data an advantage estimator may declare as keyword arguments: the prompt group of each sample, the critic's
values, the greedy baseline's score, the log-probs of the policy that sampled, the per-sample reward
components `[B, K]` (a reward that returns a dict), `Σ_v π_v²` per token (OTB), the rollout correction's
detached importance weights (None without correction), the teacher's log-probs of the sampled tokens (a session
with `teacher=`; on-policy distillation); and, from an agentic (multi-turn) task, the assistant-turn
index of each token (`-1` on padding), the environment's reward after each turn (`N` = most turns in the
batch, 0 past an episode's turns), the number of turns of each episode, and an id of the environment state
seen at the start of each turn (`-1` past the turns). It receives only those its signature names."""
BYPASS_MODES = ("ppo_clip", "reinforce")
"""`Algorithm.bypass`: verl 0.9.1's bypass-mode loss types (docs/algo/rollout_corr.md)."""
LOSS_DATA = ("weights_B_T",)
"""Data a policy loss may declare: the detached rollout-correction weights."""
DATA_KEYWORDS = set(ADVANTAGE_DATA + LOSS_DATA)
"""Every data keyword (never a hyperparameter), inputs registered with `register_advantage_input` included."""
ADVANTAGE_INPUTS: dict[str, str] = {
    "group_ids": "group_ids", "values": "values_B_T", "baseline_reward": "baselines_B", "old_logp": "old_logp_B_T",
    "sum_pi2": "sum_pi2_B_T", "correction_weights": "is_weights_B_T", "teacher_logp": "teacher_logp_B_T",
    "turn": "turn_B_T", "turn_rewards": "turn_rewards_B_N", "turns": "turns_B", "turn_state": "turn_state_B_N"}
"""Batch column -> the estimator keyword it is passed as: the one table between what `advantage()` computes and
what an estimator declares (`reward_components_B_K` stacks the columns `meta["reward_components"]` names)."""
_PROVIDERS: dict[str, Callable] = {}


def register_advantage_input(column: str, keyword: str, provide: Callable) -> None:
    """A new input an advantage estimator may declare: a session's `advantage()` computes the batch column `column`
    with `provide(session, batch)` (a tensor `[B]` or `[B, T]`) when the algorithm's estimator declares `keyword`,
    and passes it as that keyword. E.g. a per-prompt difficulty weight, a judge's score, a length target."""
    taken = {k: c for c, k in ADVANTAGE_INPUTS.items()}
    if ADVANTAGE_INPUTS.get(column, keyword) != keyword or taken.get(keyword, column) != column or (
            keyword in DATA_KEYWORDS and keyword not in taken):
        raise ValueError(f"advantage input {column!r} -> {keyword!r}: the column or the keyword is already another "
                         f"input's (the table: {ADVANTAGE_INPUTS})")
    ADVANTAGE_INPUTS[column] = keyword
    DATA_KEYWORDS.add(keyword)
    _PROVIDERS[column] = provide


def input_provider(column: str) -> Callable | None:
    """`provide(session, batch)` of a registered input column (`register_advantage_input`), else None."""
    return _PROVIDERS.get(column)


def declared(fn: Callable, data: Mapping) -> dict:
    """The entries of `data` that `fn`'s signature names (all of them if it takes `**kwargs`)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(data)
    return {k: v for k, v in data.items() if k in params}


@dataclass(frozen=True)
class _Entry:
    obj: object
    origin: str  # module that defined the function, or that registered the algorithm
    reduction: str | None = None
    description: str = ""  # a rollout correction's formula and source
    verl: str | None = None  # verl 0.9.1's name or config for the same part; None where verl has none


_TABLES: dict[str, dict[str, _Entry]] = {"algorithm": {}, "advantage": {}, "loss": {}, "correction": {}}


def _label(obj) -> str:
    """The registered name of a function (else its qualified name), or an algorithm's name."""
    if isinstance(obj, Algorithm):
        return obj.name
    for table in (_TABLES["advantage"], _TABLES["loss"]):
        for name, entry in table.items():
            if entry.obj is obj:
                return name
    return getattr(obj, "__qualname__", repr(obj))


def _register(kind: str, name: str, entry: _Entry) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {kind} name must be a non-empty string, got {name!r}")
    old = _TABLES[kind].get(name)
    rerun = (
        old is not None
        and old.origin == entry.origin == "__main__"
        and getattr(old.obj, "__qualname__", name) == getattr(entry.obj, "__qualname__", name)
    )
    same = (old is not None and (old.obj, old.reduction, old.description) == (entry.obj, entry.reduction,
                                                                              entry.description)
            and entry.verl in (None, old.verl))
    if old is not None and not same and not rerun:
        raise ValueError(
            f"{kind} {name!r} is already registered ({_label(old.obj)} from {old.origin}); pick another name"
        )
    if not same:  # the same part again is a no-op: it keeps its origin and its verl name
        _TABLES[kind][name] = entry


def _lookup(kind: str, name: str):
    table = _TABLES[kind]
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name].obj


def register_advantage(name: str, fn: Callable | None = None, *, verl: str | None = None):
    """Register an advantage estimator; usable as `@register_advantage("x")` or `register_advantage("x", fn)`.

    Contract: `fn(rewards_B_T, mask_B_T, *, <the ADVANTAGE_DATA it reads>, **hparams) -> (advantages_B_T,
    returns_B_T)`, both 0 on invalid tokens; it receives only the data keywords it declares.

    `verl`: the name of the same estimator in verl 0.9.1 (`algorithm.adv_estimator`), if it has one.
    """
    if fn is None:
        return lambda f: register_advantage(name, f, verl=verl)
    _register("advantage", name, _Entry(fn, fn.__module__, verl=verl))
    return fn


def register_loss(name: str, fn: Callable | None = None, *, reduction: str | None = None, verl: str | None = None):
    """Register a policy loss; usable as a decorator or a call, like `register_advantage`.

    Contract: `fn(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, **hparams) ->
    (loss_B_T, metrics)`: the unreduced per-token loss (times `weights_B_T` when given) and 0-d detached
    metrics. `weights_B_T` is optional: a loss without it cannot be used with rollout correction.

    `reduction` is the mode the paper fixes (an `Algorithm` using this loss then reduces with it), or None to
    leave it to the algorithm. `verl`: the name of the same loss in verl 0.9.1 (`actor.policy_loss.loss_mode`),
    if it has one.
    """
    if reduction is not None and reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction mode {reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if fn is None:
        return lambda f: register_loss(name, f, reduction=reduction, verl=verl)
    _register("loss", name, _Entry(fn, fn.__module__, reduction, verl=verl))
    return fn


def register_algorithm(algorithm_or_name: Algorithm | str, **fields) -> Algorithm:
    """Register an `Algorithm` under its name: `register_algorithm(alg)`, or build it from a name and fields,
    `register_algorithm("mine", advantage="grpo", loss="my_loss")`. Returns the algorithm."""
    if isinstance(algorithm_or_name, Algorithm):
        algorithm = algorithm_or_name.replace(**fields) if fields else algorithm_or_name
    else:
        algorithm = Algorithm(name=algorithm_or_name, **fields)
    _register("algorithm", algorithm.name, _Entry(algorithm, sys._getframe(1).f_globals.get("__name__", "")))
    return algorithm


def register_correction(name: str, correction: RolloutCorrection, *, description: str = "",
                        verl: str | None = None) -> RolloutCorrection:
    """Register a `RolloutCorrection` under a name, usable as `Algorithm(correction=name)`; `description`
    gives its formula and source (`describe(name)` shows it), `verl` the same correction in verl 0.9.1 (a
    `RolloutCorrectionConfig` preset, or the `algorithm.rollout_correction` settings), if it has one. Returns the
    correction."""
    if not isinstance(correction, RolloutCorrection):
        raise TypeError(f"register_correction takes a RolloutCorrection, got {type(correction).__name__}")
    _register("correction", name, _Entry(correction, sys._getframe(1).f_globals.get("__name__", ""),
                                         description=description, verl=verl))
    return correction


def get_correction(name_or_correction: str | RolloutCorrection | None) -> RolloutCorrection | None:
    """The rollout correction registered under a name; a `RolloutCorrection` or None passes through."""
    if name_or_correction is None or isinstance(name_or_correction, RolloutCorrection):
        return name_or_correction
    if not isinstance(name_or_correction, str):
        raise TypeError(f"correction must be a RolloutCorrection, a registered correction name or None, got "
                        f"{type(name_or_correction).__name__}")
    return _lookup("correction", name_or_correction)


def advantage_fn(name: str | Callable) -> Callable:
    """The advantage estimator registered under `name` (a callable passes through)."""
    return name if callable(name) else _lookup("advantage", name)


def loss_fn(name: str | Callable) -> Callable:
    """The policy loss registered under `name` (a callable passes through)."""
    return name if callable(name) else _lookup("loss", name)


def loss_reduction(name_or_fn: str | Callable) -> str | None:
    """The reduction mode a registered loss fixes, or None (also None for an unregistered function)."""
    if isinstance(name_or_fn, str):
        _lookup("loss", name_or_fn)
        return _TABLES["loss"][name_or_fn].reduction
    return next((e.reduction for e in _TABLES["loss"].values() if e.obj is name_or_fn), None)


def names(kind: str = "algorithm") -> list[str]:
    """Sorted registered names of `kind`: "algorithm", "advantage", "loss" or "correction"."""
    if kind not in _TABLES:
        raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(_TABLES)}")
    return sorted(_TABLES[kind])


def get(name_or_algorithm: str | Algorithm) -> Algorithm:
    """The algorithm registered under a name; an `Algorithm` passes through unchanged."""
    if isinstance(name_or_algorithm, Algorithm):
        return name_or_algorithm
    return _lookup("algorithm", name_or_algorithm)


def hyperparameters(fn: Callable) -> dict[str, object]:
    """Keyword hyperparameters of an advantage or loss and their defaults (`inspect.Parameter.empty` if none)."""
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in DATA_KEYWORDS}


def _verl_line(entry: _Entry | None) -> list[str]:
    return [] if entry is None or entry.verl is None else [f"verl: `{entry.verl}`"]


def _describe_fn(fn: Callable, kind: str) -> str:
    hparams = ", ".join(
        f"{name} (required)" if default is inspect.Parameter.empty else f"{name}={default!r}"
        for name, default in hyperparameters(fn).items()
    )
    lines = [f"{_label(fn)} ({kind})", inspect.getdoc(fn) or "(no docstring)", f"Hyperparameters: {hparams or 'none'}"]
    if kind == "loss" and loss_reduction(fn) is not None:
        lines.append(f"Reduction: {loss_reduction(fn)} (fixed by the paper)")
    entry = next((e for e in _TABLES.get(kind, {}).values() if e.obj is fn), None)
    return "\n".join(lines + _verl_line(entry))


def _describe_correction(correction: RolloutCorrection) -> str:
    name, entry = next(((n, e) for n, e in _TABLES["correction"].items() if e.obj == correction),
                       ("unregistered", None))
    return "\n".join([f"{name} (correction)", entry.description if entry else "(no description)", repr(correction)]
                     + _verl_line(entry))


def describe(name: str | Callable | Algorithm | RolloutCorrection) -> str:
    """Formula, paper and hyperparameters (with defaults) of an algorithm, advantage, loss or rollout correction.

    A name is looked up as an algorithm first, then as an advantage, a loss, a correction.
    """
    if isinstance(name, Algorithm):
        return name.describe()
    if isinstance(name, RolloutCorrection):
        return _describe_correction(name)
    if callable(name):
        kinds = [kind for kind in ("advantage", "loss") if any(e.obj is name for e in _TABLES[kind].values())]
        return _describe_fn(name, kinds[0] if kinds else "unregistered")
    for kind in ("algorithm", "advantage", "loss", "correction"):
        if name in _TABLES[kind]:
            obj = _TABLES[kind][name].obj
            if kind == "correction":
                return _describe_correction(obj)
            return obj.describe() if kind == "algorithm" else _describe_fn(obj, kind)
    known = sorted(set().union(*_TABLES.values()))
    raise ValueError(f"unknown name {name!r}; valid: {', '.join(known)}")


def _check_kwargs(fn: Callable, kwargs: Mapping, what: str) -> None:
    """`kwargs` name only hyperparameters `fn` takes, and every hyperparameter without a default (DRO's β)."""
    missing = [name for name, default in hyperparameters(fn).items()
               if default is inspect.Parameter.empty and name not in kwargs]
    if missing:
        key = "loss_kwargs" if what == "loss" else "advantage_kwargs"
        raise ValueError(f"{what} {_label(fn)!r} needs {', '.join(missing)} (no default): pass it in {key}, e.g. "
                         f"{key}={{{missing[0]!r}: ...}}")
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    unknown = sorted(set(kwargs) - {p.name for p in params})
    if unknown:
        valid = ", ".join(hyperparameters(fn)) or "none"
        raise ValueError(f"{what} {_label(fn)!r} takes no {', '.join(unknown)}; its hyperparameters: {valid}")


def _check_choice(what: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}")


@dataclass(frozen=True, repr=False)
class Algorithm:
    """An RL algorithm as data: which advantage, which loss, how to reduce it, and what the step needs.

    The session asks these fields, never the name, so a user-built algorithm works like a preset.
    `advantage` and `loss` may be given as registered names; construction resolves them to functions.
    A loss that fixes its reduction (`register_loss(..., reduction=...)`) overrides `reduction`.
    """

    name: str
    """Registry name."""
    advantage: Callable
    """Advantage estimator (function, or a registered name resolved at construction)."""
    loss: Callable
    """Per-token policy loss (function, or a registered name resolved at construction)."""
    reduction: str = "token-mean"
    """How `aggregate` reduces the per-token loss; replaced by the loss's own mode if it fixes one."""
    advantage_kwargs: Mapping = field(default_factory=dict)
    """Hyperparameters passed to the advantage (norm_by_std, gamma, lam...)."""
    loss_kwargs: Mapping = field(default_factory=dict)
    """Hyperparameters passed to the loss (clip_low, clip_high, clip_c...)."""
    kl_coef: float = 0.0
    """Coefficient of the KL to the reference in the loss (GRPO's way)."""
    kl_estimator: str = "k3"
    """Estimator of that KL (see `kl`)."""
    reward_kl_coef: float = 0.0
    """β of the KL penalty in the reward (PPO's way); the initial β when adaptive."""
    reward_kl_estimator: str = "k1"
    """Estimator of the reward KL (verl's default `kl` = k1)."""
    reward_kl_target: float | None = None
    """Target KL of the adaptive β; None keeps β fixed."""
    reward_kl_horizon: float = 10000
    """Horizon (in responses) of the adaptive β."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient: `loss -= entropy_coef·agg(H)`."""
    norm_length: int | None = None
    """`T_norm` of seq-mean-token-sum-norm; None = the max response length."""
    needs_critic: bool = False
    """Train a value model and pass its values to the advantage (`values_B_T`)."""
    needs_greedy_baseline: bool = False
    """Score a greedy rollout per prompt and pass it to the advantage (`baselines_B`)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose scores are all equal, resample to refill the batch."""
    max_filter_rounds: int = 4
    """Cap on extra sampling rounds of dynamic sampling."""
    overlong_buffer: float = 0
    """DAPO overlong shaping buffer: tokens, or a fraction of the max response length if < 1 (0 = off)."""
    overlong_factor: float = 1.0
    """Maximum overlong penalty."""
    correction: RolloutCorrection | str | None = None
    """Rollout correction for sampler/trainer mismatch: a `RolloutCorrection`, or a registered name
    (`names("correction")`: "token_tis", "seq_tis", "icepop", "mis", "geo_reject") resolved at
    construction; None = off."""
    bypass: str | None = None
    """verl 0.9.1's bypass mode (docs/algo/rollout_corr.md), one of `BYPASS_MODES`; None = off. The sampler's
    log-probs serve as `old_logp` (the session runs no old-policy forward, unless the advantage reads `Σ_v π_v²`:
    OTB) and `correction` runs inside `actor_loss`, per micro-batch, on `log ρ = sg(logp) - sampler_logp`.
    "ppo_clip": the loss on the tokens the correction's rejection keeps, without IS weights (its ratio
    `π_θ/π_sampler` already is one). "reinforce": `L = -A·logp·w`, `w` the correction's truncated IS weights
    (the `gpg` loss, which this mode requires)."""
    distill_coef: float = 0.0
    """On-policy distillation mixed with RL: `A_t += distill_coef·(-k(logπ_old_t, logπ_teacher_t))` after the
    estimator, the per-token reverse KL to the teacher (`distill_estimator`) as an extra reward on each token
    (`rlbench/algorithms/distill.py`). Needs a session with `teacher=`. 0 = off."""
    distill_estimator: str = "k1"
    """Estimator of that per-token reverse KL: "k1" or "k3"."""
    forward_kl_coef: float = 0.0
    """Forward KL to the teacher's top-`teacher_topk` distribution as a loss term, `+ forward_kl_coef·agg(D)`
    (`forward_kl_topk`; GKD's supervised term, verl's `forward_kl_topk`). Needs `teacher=`. 0 = off."""
    teacher_topk: int = 64
    """How many of the teacher's most likely tokens per position `forward_kl_coef` compares (the teacher ships
    `[B, T, k]` log-probs and ids; k at least the vocabulary size: the whole distribution)."""
    description: str = ""
    """One line for humans."""

    def __post_init__(self):
        set_field = partial(object.__setattr__, self)
        set_field("advantage", advantage_fn(self.advantage))
        set_field("loss", loss_fn(self.loss))
        set_field("reduction", loss_reduction(self.loss) or self.reduction)
        set_field("correction", get_correction(self.correction))
        set_field("advantage_kwargs", dict(self.advantage_kwargs))
        set_field("loss_kwargs", dict(self.loss_kwargs))
        _check_choice("reduction mode", self.reduction, REDUCTIONS)
        _check_choice("KL estimator", self.kl_estimator, KL_KINDS)
        _check_choice("KL estimator", self.reward_kl_estimator, KL_KINDS)
        _check_kwargs(self.advantage, self.advantage_kwargs, "advantage")
        _check_kwargs(self.loss, self.loss_kwargs, "loss")
        if self.correction is not None and not declared(self.loss, {"weights_B_T": None}):
            raise ValueError(f"loss {_label(self.loss)!r} takes no weights_B_T, so it cannot apply rollout "
                             f"correction: add a weights_B_T=None keyword (multiply the per-token loss by it)")
        if self.max_filter_rounds < 0 or self.overlong_buffer < 0:
            raise ValueError("max_filter_rounds and overlong_buffer must be >= 0")
        _check_choice("reverse-KL estimator (distill_estimator)", self.distill_estimator, REVERSE_KL_KINDS)
        if self.distill_coef < 0 or self.forward_kl_coef < 0 or self.teacher_topk < 1:
            raise ValueError(f"distill_coef and forward_kl_coef must be >= 0 and teacher_topk >= 1, got "
                             f"{self.distill_coef}, {self.forward_kl_coef}, {self.teacher_topk}")
        if self.bypass is not None:
            self._check_bypass()

    def _check_bypass(self) -> None:
        _check_choice("bypass mode", self.bypass, BYPASS_MODES)
        if self.bypass == "reinforce" and self.loss is not loss_fn("gpg"):
            raise ValueError(f"bypass='reinforce' trains L = -A·logp·w, the gpg loss, not {_label(self.loss)!r}: set "
                             f"loss='gpg', or bypass='ppo_clip' to keep this loss")
        if self.correction is not None and self.correction.normalize:
            raise ValueError("bypass mode computes the correction per micro-batch, where the batch mean of "
                             "normalize=True is not known: use a correction with normalize=False")

    @property
    def needs_turns(self) -> bool:
        """Whether the advantage reads per-turn data (an agentic task's episodes), by name in its signature."""
        return any(name in inspect.signature(self.advantage).parameters for name in TURN_DATA)

    @property
    def needs_sum_pi2(self) -> bool:
        """Whether the advantage reads `Σ_v π_v²` per token (OTB), by name in its signature: the old-policy
        forward then also returns it (the batch's `sum_pi2` column)."""
        return "sum_pi2_B_T" in inspect.signature(self.advantage).parameters

    @property
    def needs_teacher(self) -> bool:
        """Whether the step needs a teacher's log-probs (on-policy distillation): the advantage reads
        `teacher_logp_B_T` (by name in its signature), or `distill_coef` or `forward_kl_coef` is on."""
        return ("teacher_logp_B_T" in inspect.signature(self.advantage).parameters or self.distill_coef > 0
                or self.forward_kl_coef > 0)

    @property
    def inputs(self) -> list[str]:
        """The batch columns its estimator declares by name (`ADVANTAGE_INPUTS`): what `advantage()` provides."""
        params = inspect.signature(self.advantage).parameters
        return [column for column, keyword in ADVANTAGE_INPUTS.items() if keyword in params]

    @property
    def needs_reference(self) -> bool:
        """Whether the step needs reference-policy log-probs (a KL in the loss or in the reward)."""
        return self.kl_coef > 0 or self.reward_kl_coef > 0

    def replace(self, **changes) -> Algorithm:
        """A copy with some fields changed, e.g. `get("grpo").replace(name="mine", loss=my_loss)`."""
        return dataclasses.replace(self, **changes)

    def reward_kl_controller(self) -> AdaptiveKL:
        """A fresh controller of the reward-KL β this algorithm declares."""
        return AdaptiveKL(self.reward_kl_coef, self.reward_kl_target, self.reward_kl_horizon)

    def estimate(self, rewards_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                 **data) -> tuple[torch.Tensor, torch.Tensor]:
        """`(advantages_B_T, returns_B_T)` of this algorithm's estimator, given the token rewards and whatever
        of `ADVANTAGE_DATA` the caller has; the estimator receives only the keywords it declares. With
        `distill_coef`, the advantages also get the per-token reverse KL to the teacher (see there)."""
        valid = {"reward_components_B_K", *ADVANTAGE_INPUTS.values()}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise TypeError(f"unknown advantage data {unknown}; valid: {', '.join(sorted(valid))}")
        advantages_B_T, returns_B_T = self.advantage(rewards_B_T, mask_B_T, **declared(self.advantage, data),
                                                     **self.advantage_kwargs)
        if self.distill_coef > 0:
            if data.get("teacher_logp_B_T") is None or data.get("old_logp_B_T") is None:
                raise ValueError(f"algorithm {self.name!r} has distill_coef > 0: it needs teacher_logp_B_T (a session "
                                 f"with teacher=...) and old_logp_B_T")
            advantages_B_T = advantages_B_T + self.distill_coef * reverse_kl_advantages(
                data["old_logp_B_T"], data["teacher_logp_B_T"], mask_B_T, self.distill_estimator)
        return advantages_B_T, returns_B_T

    def actor_loss(
        self,
        logp_B_T: torch.Tensor,
        old_logp_B_T: torch.Tensor,
        advantages_B_T: torch.Tensor,
        mask_B_T: torch.Tensor,
        *,
        ref_logp_B_T: torch.Tensor | None = None,
        entropy_B_T: torch.Tensor | None = None,
        weights_B_T: torch.Tensor | None = None,
        topk_logp_B_T_K: torch.Tensor | None = None,
        teacher_topk_logp_B_T_K: torch.Tensor | None = None,
        num_tokens=None,
        num_seqs=None,
        norm_length: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`agg(L) - entropy_coef·agg(H) + kl_coef·agg(kl(logp, ref_logp))` and metrics,
        `+ forward_kl_coef·agg(D)` with on-policy distillation's forward KL (`topk_logp_B_T_K`: the student's
        log-probs at the teacher's top-k ids, `teacher_topk_logp_B_T_K`: the teacher's; see `forward_kl_topk`).

        Every term is reduced with this algorithm's mode and the given global counts (see `aggregate`).
        """
        length = self.norm_length if norm_length is None else norm_length
        counts = dict(mode=self.reduction, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=length)
        bypassed = {}
        if self.bypass is not None:
            if weights_B_T is not None:
                raise ValueError(f"algorithm {self.name!r} is in bypass mode: it computes its correction weights "
                                 f"itself (pass none)")
            weights_B_T, mask_B_T, bypassed = self._bypass_correction(logp_B_T, old_logp_B_T, mask_B_T)
        data = {} if weights_B_T is None else {"weights_B_T": weights_B_T}
        loss_B_T, metrics = self.loss(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, **data, **self.loss_kwargs)
        loss = aggregate(loss_B_T, mask_B_T, **counts)
        metrics = {**metrics, **bypassed, "pg_loss": loss.detach()}
        if self.entropy_coef > 0 and entropy_B_T is None:
            raise ValueError(f"algorithm {self.name!r} has entropy_coef > 0: pass entropy_B_T")
        if entropy_B_T is not None:
            entropy = aggregate(entropy_B_T, mask_B_T, **counts)
            loss = loss - self.entropy_coef * entropy
            # the metric per token whatever the reduction (Dr.GRPO's sum over a fixed length would read lower), still
            # a share of the mini-batch's that adds up over micro-batches
            metrics["entropy"] = aggregate(entropy_B_T.detach(), mask_B_T, **(counts | {"mode": "token-mean"}))
        if self.kl_coef > 0 or ref_logp_B_T is not None:
            if ref_logp_B_T is None:
                raise ValueError(f"algorithm {self.name!r} has kl_coef > 0: pass ref_logp_B_T")
            kl_loss = aggregate(kl(logp_B_T, ref_logp_B_T, self.kl_estimator), mask_B_T, **counts)
            loss = loss + self.kl_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if self.forward_kl_coef > 0:
            if topk_logp_B_T_K is None or teacher_topk_logp_B_T_K is None:
                raise ValueError(f"algorithm {self.name!r} has forward_kl_coef > 0: pass topk_logp_B_T_K and "
                                 f"teacher_topk_logp_B_T_K (a session with teacher=... computes them)")
            divergence_B_T, teacher_mass_B_T, student_mass_B_T = forward_kl_topk(topk_logp_B_T_K, teacher_topk_logp_B_T_K)
            forward_kl = aggregate(divergence_B_T, mask_B_T, **counts)
            loss = loss + self.forward_kl_coef * forward_kl
            metrics |= {"forward_kl": forward_kl.detach(),
                        "teacher_topk_mass": masked_mean(teacher_mass_B_T.detach(), mask_B_T),
                        "student_topk_mass": masked_mean(student_mass_B_T.detach(), mask_B_T)}
        return loss, metrics

    def _bypass_correction(self, logp_B_T, sampler_logp_B_T, mask_B_T):
        """Bypass mode: `(weights_B_T or None, the mask to train on, metrics)` from `log ρ = sg(logp) -
        sampler_logp`. "ppo_clip" keeps only the rejection mask; "reinforce" also the IS weights (1 without a
        correction). Rejected tokens leave this micro-batch's mask; the global counts of the reduction are the
        caller's (they keep the loss independent of the micro-batch split)."""
        if self.correction is None:
            weights_B_T, metrics = torch.ones_like(sampler_logp_B_T) * mask_B_T, {}
        else:
            weights_B_T, mask_B_T, metrics = self.correction(logp_B_T.detach(), sampler_logp_B_T, mask_B_T)
        return (weights_B_T if self.bypass == "reinforce" else None), mask_B_T, metrics

    def describe(self) -> str:
        """This algorithm's settings, then the formulas, papers and hyperparameters of its parts."""
        parts = [repr(self), _describe_fn(self.advantage, "advantage"), _describe_fn(self.loss, "loss")]
        if self.bypass is not None:
            parts.append(f"bypass mode {self.bypass!r} (verl 0.9.1, docs/algo/rollout_corr.md): old_logp = "
                         f"sampler_logp (no old-policy forward); log ρ = sg(logp) - sampler_logp drives the correction in the loss; "
                         + ("L = -A·logp·w, w the correction's truncated IS weights" if self.bypass == "reinforce" else
                            "the loss on the tokens the correction's rejection keeps, no IS weights"))
        if self.distill_coef > 0:
            parts.append(f"on-policy distillation in the advantage (GKD arXiv:2306.13649; Thinking Machines 2025): "
                         f"A_t += {self.distill_coef:g}·(-k(logπ_old_t, logπ_teacher_t)), k = {self.distill_estimator}")
        if self.forward_kl_coef > 0:
            parts.append(f"forward KL to the teacher's top-{self.teacher_topk} distribution in the loss (GKD; verl's "
                         f"forward_kl_topk): + {self.forward_kl_coef:g}·agg(Σ_topk p_t·(log p_t - log q_s))")
        return "\n\n".join(parts + ([] if self.correction is None else [_describe_correction(self.correction)]))

    def __repr__(self) -> str:
        changed = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name in ("name", "advantage", "loss", "reduction") or value != default:
                changed.append(f"{f.name}={_label(value) if f.name in ('advantage', 'loss') else repr(value)}")
        return f"Algorithm({', '.join(changed)})"
