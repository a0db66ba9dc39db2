"""Registry semantics, the Algorithm record, describe(), docstrings."""

import ast
import dataclasses
import pathlib
import pickle
import re
import sys

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import (
    Algorithm,
    advantage_fn,
    advantages,
    describe,
    get,
    loss_fn,
    loss_reduction,
    losses,
    names,
    register_algorithm,
    register_loss,
    registry,
)


@pytest.fixture(autouse=True)
def restore_registry():
    saved = {kind: dict(table) for kind, table in registry._TABLES.items()}
    yield
    for kind, table in registry._TABLES.items():
        table.clear()
        table.update(saved[kind])


def test_names():
    assert names() == sorted(names())
    assert {"grpo", "dapo", "ppo", "dppo"} <= set(names("algorithm"))
    assert set(names("advantage")) == {
        "gae", "gdpo", "gigpo", "gpg", "grpo", "grpo_passk", "mt_grpo", "opo", "otb", "reinforce_plus_plus", "reverse_kl",
        "reinforce_plus_plus_baseline", "remax", "rloo", "tir_otb", "turn_rloo",
    }
    assert set(names("loss")) == {
        "cispo", "clip_cov", "dppo_kl", "dppo_tv", "dro", "gmpo", "gpg", "gspo", "kl_cov", "ppo_clip", "sapo",
    }
    with pytest.raises(ValueError, match="valid: algorithm, advantage, loss"):
        names("losses")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown algorithm 'grpoo'; valid: cispo, clip_cov, dapo, "):
        get("grpoo")
    with pytest.raises(ValueError, match=r"^unknown loss 'vanilla'; valid: cispo, clip_cov, "):
        loss_fn("vanilla")
    with pytest.raises(ValueError, match=r"^unknown advantage 'ppo'; valid: gae, gdpo, "):
        advantage_fn("ppo")
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        describe("nope")


def test_duplicate_name_with_a_different_function_raises():
    register_loss("ppo_clip", losses.ppo_clip)  # the same function again: a no-op
    with pytest.raises(ValueError, match="'ppo_clip' is already registered"):
        register_loss("ppo_clip", losses.gpg)
    with pytest.raises(ValueError, match="already registered"):
        register_loss("gmpo", losses.gmpo)  # same function, but without its declared reduction
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("grpo", advantage="rloo", loss="ppo_clip")
    register_algorithm(get("grpo"))  # the same algorithm again: a no-op


def test_unknown_reduction_at_registration():
    with pytest.raises(ValueError, match="unknown reduction mode 'mean'"):
        register_loss("bad", losses.gpg, reduction="mean")


CELL = """
from rlbench.algorithms import register_algorithm, register_loss

@register_loss("nb_loss")
def nb_loss(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, scale=SCALE):
    return -scale * advantages_B_T * logp_B_T, {}

register_algorithm("nb_alg", advantage="grpo", loss=nb_loss, kl_coef=KL)
"""


def run_cell(code=CELL, **constants):
    namespace = {"__name__": "__main__", **constants}  # what a notebook cell runs in
    exec(code, namespace)
    return namespace


def test_rerunning_a_notebook_cell_replaces_its_definitions():
    run_cell(SCALE=1.0, KL=0.0)
    second = run_cell(SCALE=2.0, KL=0.1)
    assert loss_fn("nb_loss") is second["nb_loss"]
    assert get("nb_alg").kl_coef == 0.1 and get("nb_alg").loss is second["nb_loss"]


def test_notebook_cannot_take_a_name_it_did_not_define():
    run_cell(SCALE=1.0, KL=0.0)
    other = "from rlbench.algorithms import register_loss\nregister_loss('nb_loss', lambda *a, **k: None)"
    with pytest.raises(ValueError, match="already registered"):
        run_cell(other)  # a different __qualname__
    with pytest.raises(ValueError, match="already registered"):
        run_cell(CELL.replace('"nb_loss"', '"ppo_clip"'), SCALE=1.0, KL=0.0)  # a library name
    with pytest.raises(ValueError, match="already registered"):
        run_cell(CELL.replace('"nb_alg"', '"grpo"'), SCALE=1.0, KL=0.0)  # a preset


def test_custom_loss_composes_with_a_preset():
    @register_loss("reinforce_capped")
    def reinforce_capped(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, max_ratio=2.0):
        """Capped REINFORCE: L = -sg(min(r, max_ratio))·A·logp. Example for the tests, arXiv:0000.00000."""
        ratio_B_T = torch.exp(logp_B_T - old_logp_B_T).clamp(max=max_ratio).detach()
        loss_B_T = -ratio_B_T * advantages_B_T * logp_B_T
        return (loss_B_T if weights_B_T is None else loss_B_T * weights_B_T), {}

    mine = register_algorithm(get("grpo").replace(name="mine", loss="reinforce_capped", loss_kwargs={"max_ratio": 1.5}))
    assert get("mine") is mine and mine.loss is reinforce_capped
    # on-policy, A = 1, logp = [-1, -2], ref = logp (KL 0): L = [1, 2], seq-mean-token-mean = 1.5
    logp_B_T = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ones_B_T = torch.ones(1, 2)
    loss, _ = mine.actor_loss(logp_B_T, logp_B_T.detach(), ones_B_T, ones_B_T, ref_logp_B_T=logp_B_T.detach())
    assert loss.item() == approx(1.5)
    loss.backward()
    assert_close(logp_B_T.grad, torch.tensor([[-0.5, -0.5]]))  # -A / 2 tokens
    assert "max_ratio=2.0" in describe("reinforce_capped")


def test_actor_loss_adds_kl_and_entropy():
    # grpo: on-policy ppo_clip L = -A = [-1, -1] -> -1 ; k3 with κ = ref - logp = [0, 1]: [0, e - 2] -> mean 0.359141
    # total = -1 + 0.001·0.359141 ; with entropy_coef 0.01 and H = [0.5, 1.5] (mean 1): - 0.01
    alg = get("grpo")
    logp_B_T = torch.tensor([[-1.0, -2.0]])
    inputs = (logp_B_T, logp_B_T, torch.ones(1, 2), torch.ones(1, 2))
    loss, metrics = alg.actor_loss(*inputs, ref_logp_B_T=torch.tensor([[-1.0, -1.0]]))
    assert loss.item() == approx(-1 + 0.001 * (2.718282 - 2) / 2)
    assert metrics["pg_loss"].item() == approx(-1.0)
    assert metrics["kl_loss"].item() == approx(0.359141)
    loss, metrics = alg.replace(entropy_coef=0.01).actor_loss(
        *inputs, ref_logp_B_T=torch.tensor([[-1.0, -1.0]]), entropy_B_T=torch.tensor([[0.5, 1.5]])
    )
    assert loss.item() == approx(-1 + 0.001 * 0.359141 - 0.01)
    with pytest.raises(ValueError, match="ref_logp_B_T"):
        alg.actor_loss(*inputs)
    with pytest.raises(ValueError, match="entropy_B_T"):
        get("dapo").replace(entropy_coef=0.01).actor_loss(*inputs)


def test_the_entropy_metric_is_per_token_whatever_the_reduction():
    # H = [[0.5, 1.5, (pad)], [1.0, (pad), (pad)]]: per token (0.5 + 1.5 + 1) / 3 = 1. Dr.GRPO's loss term sums over
    # a fixed length 3 per row, (2 + 1) / (2·3) = 0.5, and GRPO's averages each row first, (1 + 1) / 2 = 1
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    entropy_B_T = torch.tensor([[0.5, 1.5, 9.0], [1.0, 9.0, 9.0]])
    logp_B_T = torch.zeros(2, 3)
    for name in ("grpo", "dr_grpo", "gspo"):
        alg = get(name).replace(kl_coef=0.0, entropy_coef=0.1)
        loss, metrics = alg.actor_loss(logp_B_T, logp_B_T, torch.zeros(2, 3), mask_B_T, entropy_B_T=entropy_B_T)
        assert metrics["entropy"].item() == approx(1.0), name
    assert loss.item() == approx(-0.1 * 1.0)  # gspo's loss term: seq-mean-token-mean
    loss, _ = get("dr_grpo").replace(entropy_coef=0.1).actor_loss(logp_B_T, logp_B_T, torch.zeros(2, 3), mask_B_T,
                                                                   entropy_B_T=entropy_B_T)
    assert loss.item() == approx(-0.1 * 0.5)  # the loss keeps the reduction


def test_algorithm_resolves_names_and_the_declared_reduction_wins():
    alg = Algorithm(name="x", advantage="grpo", loss="sapo", reduction="token-mean")
    assert alg.advantage is advantages.grpo and alg.loss is losses.sapo
    assert alg.reduction == "seq-mean-token-mean"
    assert get("dapo").replace(loss="gmpo", loss_kwargs={}).reduction == "seq-mean-token-mean"
    assert loss_reduction("ppo_clip") is None and loss_reduction(losses.sapo) == "seq-mean-token-mean"
    assert loss_reduction(lambda *a: None) is None


def test_algorithm_validates_its_fields():
    with pytest.raises(ValueError, match="takes no eps; its hyperparameters: clip_low, clip_high, clip_c"):
        Algorithm(name="x", advantage="grpo", loss="ppo_clip", loss_kwargs={"eps": 0.2})
    with pytest.raises(ValueError, match="takes no clip_c, clip_high"):
        get("dapo").replace(loss="gpg")  # dapo's clip settings do not fit gpg
    with pytest.raises(ValueError, match="unknown reduction mode"):
        Algorithm(name="x", advantage="grpo", loss="ppo_clip", reduction="mean")
    with pytest.raises(ValueError, match="unknown KL estimator"):
        Algorithm(name="x", advantage="grpo", loss="ppo_clip", kl_estimator="k4")
    with pytest.raises(ValueError, match="unknown loss"):
        Algorithm(name="x", advantage="grpo", loss="ppo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        get("grpo").kl_coef = 0.0


def test_algorithm_declarations():
    assert get("grpo").needs_reference and get("reinforce_pp").needs_reference
    assert not get("dapo").needs_reference
    assert get(get("ppo")) is get("ppo")
    controller = get("reinforce_pp").reward_kl_controller()
    assert controller.update(1.0, n_steps=1000) == 0.001  # fixed
    adaptive = get("reinforce_pp").replace(reward_kl_target=0.1).reward_kl_controller()
    assert adaptive.update(1.0, n_steps=1000) == approx(0.001 * 1.02)  # error clipped to 0.2


def test_algorithm_pickles_and_prints():
    assert pickle.loads(pickle.dumps(get("dapo"))) == get("dapo")
    text = repr(get("dapo"))
    assert text.startswith("Algorithm(name='dapo', advantage=grpo, loss=ppo_clip, reduction='token-mean',")
    assert "clip_high" in text


def test_describe_shows_formula_paper_and_hyperparameters():
    text = describe("ppo_clip")
    assert "Lc = max(-A·r" in text and "arXiv:1707.06347" in text and "clip_low=0.2, clip_high=0.2, clip_c=3.0" in text
    text = describe("grpo")  # the preset: its settings, then its advantage and loss
    assert "kl_coef=0.001" in text and "arXiv:2402.03300" in text and "norm_by_std=True" in text
    assert "Reduction: seq-mean-token-mean (fixed by the paper)" in describe("sapo")
    assert describe(losses.gpg).startswith("gpg (loss)")
    assert describe(advantages.gpg).startswith("gpg (advantage)")


@pytest.mark.parametrize("kind", ["algorithm", "advantage", "loss", "correction"])
def test_describe_reads_as_plain_text(kind):
    """A notebook prints describe() as it is: code is marked `x`, never reStructuredText's ``x``."""
    assert not [name for name in names(kind) if "``" in describe(name)]


@pytest.mark.parametrize("kind", ["advantage", "loss"])
def test_every_registered_function_documents_formula_and_paper(kind):
    lookup = advantage_fn if kind == "advantage" else loss_fn
    for name in names(kind):
        doc = lookup(name).__doc__ or ""
        assert re.search(r"arXiv:\d{4}\.\d{4,5}", doc), f"{kind} {name}: no arXiv id in its docstring"
        assert "=" in doc and "Differs from" in doc, f"{kind} {name}: no formula or no parent in its docstring"


def test_every_preset_names_its_paper():
    for name in names():
        assert re.search(r"arXiv:\d{4}\.\d{4,5}", get(name).description), name


def test_algorithms_is_ground_floor():
    # only torch and the standard library; relative imports stay inside rlbench.algorithms
    package = pathlib.Path(registry.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." * node.level} if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"torch", ".", "__future__"} | sys.stdlib_module_names, (path.name, roots)
            assert not any(alias.name.startswith("torch.distributed") for alias in node.names), path.name
