"""docs/algorithms.md, written from the registry, so that the page cannot drift from the code.

Every registered advantage estimator, policy loss and rollout correction, every reduction mode and KL estimator,
and every preset: its formula and source (its docstring, or a correction's description), its hyperparameters with
their defaults, and its verl 0.9.1 name (the registry's `verl=`). `python -m rlbench.algorithms.reference` rewrites
the page; tests/test_algorithms_doc.py fails when the page and the code disagree.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable

from .. import core, registry, sampling
from ..correction import Rejection, RolloutCorrection
from ..registry import ADVANTAGE_DATA, BYPASS_MODES, Algorithm, hyperparameters

PACKAGE = __name__.rpartition(".")[0]
NONE = "—"
KL_COLUMNS = {"kl_coef", "kl_estimator", "reward_kl_coef", "reward_kl_estimator", "reward_kl_target",
              "reward_kl_horizon"}
BUILDING_BLOCKS = (core.masked_mean, core.masked_var, core.masked_whiten, core.ratio, core.outcome_rewards,
                   core.entropy_from_logits, core.value_loss, sampling.filter_groups, sampling.overlong_penalty,
                   core.reverse_kl_advantages, core.forward_kl_topk)


def reference_markdown(builtin: bool = False) -> str:
    """The algorithm reference as markdown. `builtin=True`: only the parts this package registers (what
    docs/algorithms.md shows); else also those a user's code registered."""
    sections = [_intro(), _advantages(builtin), _losses(builtin), _reductions(), _kl(), _corrections(builtin),
                _presets(builtin), _building_blocks()]
    return "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------------------------- markdown


def _doc(obj) -> str:
    return inspect.getdoc(obj) or "(no docstring)"


def _summary(doc: str) -> str:
    return doc.split("\n\n")[0].replace("\n", " ")


def _contract(register: Callable) -> str:
    """The "Contract: ..." paragraph of a `register_*` docstring."""
    return next(p for p in _doc(register).split("\n\n") if p.startswith("Contract:"))


def _prose(doc: str) -> str:
    """A docstring without its summary line and its indented blocks (the table `_rows` reads)."""
    paragraphs = doc.split("\n\n")[1:]
    return "\n\n".join(p for p in paragraphs if not all(line.startswith(" ") for line in p.splitlines()))


def _rows(doc: str, names) -> dict[str, tuple[str, str]]:
    """The rows `name  formula  (note)` of a docstring's indented table: {name: (formula, note)} for `names`."""
    rows = {}
    for line in doc.splitlines():
        match = re.fullmatch(r"\s+(\S+)\s{2,}(.*?)(?:\s{2,}\((.*)\))?", line)
        if match and match[1] in names:
            rows[match[1]] = (match[2], match[3] or "")
    missing = [name for name in names if name not in rows]
    if missing:
        raise ValueError(f"no row `name  formula` for {', '.join(missing)} in the docstring")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text) -> str:
    return f"`{text}`"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(_cell(cell) for cell in line) + " |" for line in lines)


def _anchor(kind: str, name: str) -> str:
    return f"{kind}-" + re.sub(r"[^\w-]", "-", name)


def _link(kind: str, name: str) -> str:
    return f"[{_code(name)}](#{_anchor(kind, name)})"


def _heading(kind: str, name: str) -> str:
    return f'### <a id="{_anchor(kind, name)}"></a>{_code(name)}'


def _sources(text: str) -> str:
    return ", ".join(dict.fromkeys(re.findall(r"arXiv:\d{4}\.\d{4,5}", text))) or NONE


def _call(fn: Callable) -> str:
    """`name(a, b, *, c=1)`: the signature without annotations."""
    signature = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return f"{fn.__name__}{signature.replace(parameters=params, return_annotation=inspect.Signature.empty)}"


# ---------------------------------------------------------------------------------------------------- registry


def _entries(kind: str, builtin: bool) -> dict[str, registry._Entry]:
    """Registered name -> entry, sorted by name; with `builtin`, only the entries this package registered."""
    table = registry._TABLES[kind]
    return {name: table[name] for name in registry.names(kind)
            if not builtin or table[name].origin == PACKAGE or table[name].origin.startswith(PACKAGE + ".")}


def _verl(entry: registry._Entry) -> str:
    return NONE if entry.verl is None else _code(entry.verl)


def _hyperparameters(fn: Callable) -> str:
    return ", ".join(_code(name) + " (required)" if default is inspect.Parameter.empty else _code(f"{name}={default!r}")
                     for name, default in hyperparameters(fn).items()) or "none"


def _functions(kind: str, builtin: bool, facts: Callable[[registry._Entry], list[str]]) -> str:
    """An index table of the registered functions of `kind`, then each one: its facts and its docstring."""
    entries = _entries(kind, builtin)
    index = _table([kind, "what it computes", "verl 0.9.1", "source"],
                   [[_link(kind, name), _summary(_doc(e.obj)), _verl(e), _sources(_doc(e.obj))]
                    for name, e in entries.items()])
    details = [f"{_heading(kind, name)}\n\n" + " · ".join(facts(e)) + f"\n\n{_doc(e.obj)}"
               for name, e in entries.items()]
    return "\n\n".join([index, *details])


# ---------------------------------------------------------------------------------------------------- sections


def _intro() -> str:
    return f"""# Algorithm reference

<!-- Written by `python -m rlbench.algorithms.reference` from the registry of `rlbench.algorithms`: do not edit
by hand. tests/test_algorithms_doc.py fails when this page and the code disagree. -->

Every part `rlbench.algorithms` registers: advantage estimators, policy losses, reductions, KL estimators, rollout
corrections and the presets built from them. Each entry gives the formula and the source its docstring states, its
hyperparameters with their defaults, and its name in verl 0.9.1 (the registry name or the config value that selects
the same computation; "{NONE}" where verl has none). The entries are the parts' own docstrings:
`rl.algorithms.describe(name)` prints the same text, and
`rl.algorithms.reference.reference_markdown()` writes this page with your own registered parts included.

## Conventions

- Shapes are in names: `logp_B_T` is `[B, T]`, `B` responses by `T` response tokens. The samples of one prompt share
  a group id (`group_ids`, `[B]`).
- `mask_B_T` is 1 on the tokens the policy sampled (the stop token included), 0 on padding; in an agentic episode also
  0 on the tool output between turns, so it may have holes (docs/turn_credit.md). Every estimator, loss and reduction
  gives on a holed row what it gives on the row with the holes removed.
- Rewards are per token, `rewards_B_T`: a response's score sits on its last valid token (`outcome_rewards`), so its
  score is `s_i = Σ_t r_{{i,t}}`.
- `logp` are the log-probs of the policy being trained (with gradient), `old_logp` those of the policy that produced
  the batch, `ref_logp` the reference's, `sampler_logp` the sampler's own. `r = exp(clamp(logp - old_logp, ±20))` is
  the token ratio, `sg` the stop-gradient, `agg` the algorithm's reduction. The masked statistics (`masked_mean`,
  `masked_whiten`, ...) are under [Building blocks](#building-blocks).

## How a preset composes its parts

{_doc(Algorithm)}

A step runs the parts in this order:

1. **Rewards.** The task's score on each response's last valid token; with `reward_kl_coef > 0`, minus `β·kl` on
   every token ([KL to the reference](#kl-to-the-reference)).
2. **Rollout correction** (`correction`, optional). Importance weights for the loss and a rejection mask from the
   sampler/trainer mismatch ([Rollout corrections](#rollout-corrections)); advantages are computed on the mask it
   keeps.
3. **Advantages** (`advantage`, `advantage_kwargs`). {_summary(_doc(Algorithm.estimate))}
4. **Loss** (`loss`, `loss_kwargs`, `reduction`, `kl_coef`, `entropy_coef`). {_summary(_doc(Algorithm.actor_loss))}

`rl.algorithms.get(name)` returns a preset, `get(name).replace(...)` a variant of it."""


def _advantages(builtin: bool) -> str:
    def facts(entry):
        reads = [key for key in inspect.signature(entry.obj).parameters if key in ADVANTAGE_DATA]
        return [f"verl: {_verl(entry)}", f"hyperparameters: {_hyperparameters(entry.obj)}",
                "reads: " + (", ".join(map(_code, reads)) or "rewards and mask only")]

    return f"""## Advantage estimators

{_contract(registry.register_advantage)} verl's name is its `algorithm.adv_estimator`.

{_functions("advantage", builtin, facts)}"""


def _losses(builtin: bool) -> str:
    def facts(entry):
        lines = [f"verl: {_verl(entry)}", f"hyperparameters: {_hyperparameters(entry.obj)}"]
        return lines + ([] if entry.reduction is None else [f"reduction: {_code(entry.reduction)}, fixed by the paper"])

    return f"""## Policy losses

{_contract(registry.register_loss)} verl's name is its
`actor_rollout_ref.actor.policy_loss.loss_mode`; verl's losses reduce themselves, here [a reduction](#reductions)
does.

{_functions("loss", builtin, facts)}"""


def _reductions() -> str:
    doc = _doc(core.aggregate)
    rows = _rows(doc, core.REDUCTIONS)
    table = _table(["mode", "value", "verl 0.9.1 (`loss_agg_mode`)", "used by"],
                   [[_code(mode), _code(rows[mode][0]), _code(mode), rows[mode][1] or NONE] for mode in core.REDUCTIONS])
    return f"""## Reductions

{_code(_call(core.aggregate))}: {_summary(doc)} An algorithm's `reduction` names the mode; a loss that fixes its
mode overrides it. `N` is the number of valid tokens, `B` of responses.

{table}

{_prose(doc)}"""


def _kl() -> str:
    doc = _doc(core.kl)
    bases = [kind for kind in core.KL_KINDS if not kind.endswith("+")]
    rows = _rows(doc, bases)
    table = _table(["estimator", "value", "straight-through", "verl 0.9.1", "note"],
                   [[_code(kind), _code(rows[kind][0]), _code(kind + "+") if kind + "+" in core.KL_KINDS else NONE,
                     _code(kind), rows[kind][1] or NONE] for kind in bases])
    defaults = ", ".join(_code(f"{f.name}={f.default!r}") for f in dataclasses.fields(Algorithm) if f.name in KL_COLUMNS)
    return f"""## KL to the reference

{_code(_call(core.kl))}: {_summary(doc)} An algorithm puts it in the loss, `+ kl_coef·agg(kl)` (GRPO's way),
or in the reward (PPO's way); the defaults of `Algorithm`: {defaults}.

{table}

{_prose(doc)}

### In the reward

{_doc(core.kl_in_reward)}

{_doc(core.AdaptiveKL)}"""


def _corrections(builtin: bool) -> str:
    entries = _entries("correction", builtin)
    index = _table(["correction", "verl 0.9.1"], [[_link("correction", name), _verl(e)] for name, e in entries.items()])
    details = [f"{_heading('correction', name)}\n\nverl: {_verl(e)}\n\n    {e.obj!r}\n\n"
               + (e.description or "(no description)") for name, e in entries.items()]
    bypass = ", ".join(_link("algorithm", name) for name in _entries("algorithm", builtin)
                       if registry.get(name).bypass is not None)
    return f"""## Rollout corrections

The sampler's log-probs (`sampler_logp`) and the trainer's (`old_logp`) differ: other kernels, other dtypes, stale
weights. A correction turns `log ρ = old_logp - sampler_logp` into importance weights for the loss and a rejection
mask; `Algorithm(correction=name)` takes a registered one, or a `RolloutCorrection` of your own.

{_doc(RolloutCorrection)}

{_doc(Rejection)}

Bypass mode (`Algorithm.bypass`, one of {", ".join(map(_code, BYPASS_MODES))}: verl 0.9.1's
`rollout_correction.bypass_mode` with its `loss_type`) takes the sampler's log-probs as `old_logp` and runs the
correction inside the loss; the presets {bypass or NONE} use it.

""" + "\n\n".join([index, *details])


def _part(kind: str, fn: Callable) -> str:
    name = registry._label(fn)
    return _link(kind, name) if name in registry._TABLES[kind] else _code(name)


def _kl_cell(algorithm: Algorithm) -> str:
    cells = []
    if algorithm.kl_coef > 0:
        cells.append(f"loss {_code(algorithm.kl_estimator)} × {algorithm.kl_coef:g}")
    if algorithm.reward_kl_coef > 0:
        adaptive = (f", adaptive to {algorithm.reward_kl_target:g} over {algorithm.reward_kl_horizon:g}"
                    if algorithm.reward_kl_target is not None else "")
        cells.append(f"reward {_code(algorithm.reward_kl_estimator)} × {algorithm.reward_kl_coef:g}{adaptive}")
    return "; ".join(cells) or NONE


def _correction_cell(correction: RolloutCorrection | None) -> str:
    if correction is None:
        return NONE
    name = next((n for n, e in registry._TABLES["correction"].items() if e.obj == correction), None)
    return _code(repr(correction)) if name is None else _link("correction", name)


def _also_sets(algorithm: Algorithm) -> str:
    shown = {"name", "advantage", "loss", "reduction", "correction", "description"}
    shown |= {"kl_coef", "reward_kl_coef"} | ({"kl_estimator"} if algorithm.kl_coef > 0 else set())
    shown |= {f for f in KL_COLUMNS if f.startswith("reward_kl")} if algorithm.reward_kl_coef > 0 else set()
    changed = []
    for f in dataclasses.fields(Algorithm):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name not in shown and getattr(algorithm, f.name) != default:
            changed.append(_code(f"{f.name}={getattr(algorithm, f.name)!r}"))
    return ", ".join(changed) or NONE


def _presets(builtin: bool) -> str:
    rows = []
    for name in _entries("algorithm", builtin):
        algorithm = registry.get(name)
        rows.append([f'<a id="{_anchor("algorithm", name)}"></a>{_code(name)}', _part("advantage", algorithm.advantage),
                     _part("loss", algorithm.loss), _code(algorithm.reduction), _kl_cell(algorithm),
                     _correction_cell(algorithm.correction), _also_sets(algorithm), algorithm.description or NONE])
    table = _table(["preset", "advantage", "loss", "reduction", "KL", "correction", "also sets", "description"], rows)
    return f"""## Presets

`rl.algorithms.get(name)`. A preset states only what differs from the defaults of its parts (the hyperparameters
listed with each part above) and of `Algorithm`; in verl the same run sets the verl names of its parts.

{table}"""


def _building_blocks() -> str:
    blocks = [f"### {_code(_call(fn))}\n\n{_doc(fn)}" for fn in BUILDING_BLOCKS]
    return "## Building blocks\n\nThe shared tensor functions the parts above are written with.\n\n" + "\n\n".join(blocks)
