"""docs/algorithms.md is the registry's: written by `python -m rlbench.algorithms.reference`, it lists every registered
part, a part registered by the user's code shows up in the generated text, and no page points at a reference outside
the repository."""

import re
from pathlib import Path

from rlbench.algorithms import KL_KINDS, REDUCTIONS, advantage_fn, describe, loss_fn, names, register_loss, registry
from rlbench.algorithms.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "algorithms.md"


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n")[1].split("\n## ")[0]


def test_the_page_is_the_generators_output():
    assert PAGE.read_text() == reference_markdown(builtin=True), \
        "docs/algorithms.md is stale: run python -m rlbench.algorithms.reference"


def test_every_registered_name_of_every_kind_is_on_the_page():
    text = PAGE.read_text()
    for kind in ("advantage", "loss", "correction", "algorithm"):
        missing = [name for name in names(kind) if f'<a id="{kind}-{name}"></a>`{name}`' not in text]
        assert not missing, (kind, missing)
    for heading, choices in (("Reductions", REDUCTIONS), ("KL to the reference", KL_KINDS)):
        section = _section(text, heading)
        assert not [choice for choice in choices if f"`{choice}`" not in section], heading


def test_every_part_verl_has_shows_its_verl_name():
    # verl 0.9.1's names where they differ from ours, on the page and in describe()
    for part, verl in ((loss_fn("ppo_clip"), "vanilla"), (loss_fn("gmpo"), "geo_mean"),
                       (advantage_fn("otb"), "optimal_token_baseline"), ("token_tis", "decoupled_token_is")):
        assert f"verl: `{verl}`" in describe(part) and f"verl: `{verl}`" in PAGE.read_text()
    assert "verl:" not in describe(advantage_fn("turn_rloo"))  # verl has no per-turn leave-one-out


def test_a_part_registered_by_user_code_is_in_the_generated_text(monkeypatch):
    monkeypatch.setattr(registry, "_TABLES", {kind: dict(table) for kind, table in registry._TABLES.items()})

    @register_loss("doc_probe_loss", verl="vanilla")
    def doc_probe_loss(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, scale: float = 42.0):
        """A loss for this test: the policy gradient, scaled.

            L = -scale·A·logp

        Differs from `gpg` by the scale. Nobody et al., arXiv:0000.00000.
        """
        return -scale * advantages_B_T * logp_B_T, {}

    text = reference_markdown()
    entry = _section(text, "Policy losses").split('<a id="loss-doc_probe_loss"></a>`doc_probe_loss`')[1]
    assert "    L = -scale·A·logp" in entry and "`scale=42.0`" in entry and "arXiv:0000.00000" in entry
    assert "doc_probe_loss" not in reference_markdown(builtin=True)


def test_no_page_points_outside_the_repository():
    """The algorithm reference is docs/algorithms.md; the notes it was first written from are not in the repo."""
    paths = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md"]
    for folder, pattern in (("docs", "*.md"), ("rlbench", "*.py"), ("notebooks", "*.ipynb"), ("algorithms", "*.toml")):
        paths += sorted((ROOT / folder).rglob(pattern))
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in paths
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\.\./shared|ALGORITHMS\.md", line)]
    assert not offenders, offenders
