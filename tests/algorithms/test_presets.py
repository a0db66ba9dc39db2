"""The presets (docs/algorithms.md): their declarations, and each one running on a random batch."""

import pytest
import torch
from floats import assert_close

from rlbench.algorithms import advantage_fn, get, loss_fn, names

# preset: (advantage, loss, reduction, fields that must hold)
TABLE = {
    "grpo": ("grpo", "ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.001, kl_estimator="k3")),
    "dr_grpo": (
        "grpo", "ppo_clip", "seq-mean-token-sum-norm", dict(kl_coef=0.0, advantage_kwargs={"norm_by_std": False})
    ),
    "dapo": (
        "grpo", "ppo_clip", "token-mean",
        dict(loss_kwargs={"clip_high": 0.28, "clip_c": 10.0}, filter_groups=True, kl_coef=0.0, reward_kl_coef=0.0),
    ),
    "gspo": ("grpo", "gspo", "seq-mean-token-mean", {}),
    "rloo": ("rloo", "ppo_clip", "token-mean", {}),
    "reinforce_pp": ("reinforce_plus_plus", "ppo_clip", "token-mean", dict(reward_kl_coef=0.001)),
    "reinforce_pp_baseline": ("reinforce_plus_plus_baseline", "ppo_clip", "token-mean", dict(reward_kl_coef=0.001)),
    "remax": ("remax", "ppo_clip", "token-mean", dict(needs_greedy_baseline=True)),
    "ppo": ("gae", "ppo_clip", "token-mean", dict(needs_critic=True)),
    "cispo": ("grpo", "cispo", "token-mean", {}),
    "gmpo": ("grpo", "gmpo", "seq-mean-token-mean", {}),
    "sapo": ("grpo", "sapo", "seq-mean-token-mean", {}),
    "gpg": ("gpg", "gpg", "token-mean", {}),
    "clip_cov": ("grpo", "clip_cov", "token-mean", {}),
    "kl_cov": ("grpo", "kl_cov", "token-mean", {}),
    "opo": ("opo", "ppo_clip", "token-mean", {}),
    "grpo_passk": ("grpo_passk", "ppo_clip", "token-mean", {}),
    "dppo": ("grpo", "dppo_tv", "seq-mean-token-sum-norm", dict(advantage_kwargs={"norm_by_std": False})),
    "grpo_bypass": ("grpo", "ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.001, bypass="ppo_clip", correction=None)),
    "grpo_bypass_pg": ("grpo", "gpg", "seq-mean-token-mean", dict(kl_coef=0.001, bypass="reinforce")),
    "opd": ("reverse_kl", "ppo_clip", "token-mean", dict(kl_coef=0.0, needs_teacher=True)),
    "grpo_opd": ("grpo", "ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.0, distill_coef=1.0, needs_teacher=True)),
    "mt_grpo": ("mt_grpo", "ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.001, needs_turns=True)),
    "gigpo": ("gigpo", "ppo_clip", "seq-mean-token-mean", dict(kl_coef=0.0, needs_turns=True)),
    "turn_rloo": ("turn_rloo", "ppo_clip", "token-mean", dict(needs_turns=True)),
}


def test_table_covers_every_preset():
    assert set(TABLE) == set(names())


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_declaration(name):
    advantage, loss, reduction, fields = TABLE[name]
    alg = get(name)
    assert alg.name == name
    assert alg.advantage is advantage_fn(advantage) and alg.loss is loss_fn(loss)
    assert alg.reduction == reduction
    for field, value in fields.items():
        assert getattr(alg, field) == value, field


def random_batch(seed=0):
    """8 responses in 2 groups of 4, ragged lengths, outcome scores with a unique best per group."""
    generator = torch.Generator().manual_seed(seed)
    B, T = 8, 6
    lengths_B = torch.tensor([6, 3, 1, 5, 4, 6, 2, 3])
    mask_B_T = (torch.arange(T) < lengths_B[:, None]).float()
    rewards_B_T = torch.zeros(B, T)
    rewards_B_T[torch.arange(B), lengths_B - 1] = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.3, 1.0, 0.0])
    old_logp_B_T = -torch.rand(B, T, generator=generator) * 3
    turns_B = 1 + (lengths_B >= 2).long()
    return dict(
        rewards_B_T=rewards_B_T,
        mask_B_T=mask_B_T,
        lengths_B=lengths_B,
        group_ids=torch.tensor([3, 3, 3, 3, 8, 8, 8, 8]),
        values_B_T=torch.randn(B, T, generator=generator),
        baselines_B=torch.rand(B, generator=generator),
        old_logp_B_T=old_logp_B_T,
        logp_B_T=old_logp_B_T + 0.2 * torch.randn(B, T, generator=generator),
        ref_logp_B_T=old_logp_B_T + 0.2 * torch.randn(B, T, generator=generator),
        teacher_logp_B_T=old_logp_B_T + 0.5 * torch.randn(B, T, generator=generator),
        # the student's offsets from its sampled token's log-prob at a teacher's top-3 ids, and the teacher's there
        topk_offsets_B_T_K=-torch.rand(B, T, 3, generator=generator),
        teacher_topk_logp_B_T_K=torch.log_softmax(torch.randn(B, T, 4, generator=generator), -1)[..., :3],
        entropy_B_T=torch.rand(B, T, generator=generator),
        # two turns per response of 2+ tokens (its second half is turn 1), for the turn-credit presets
        turns_B=turns_B,
        turn_B_T=((torch.arange(T) >= (lengths_B[:, None] + 1) // 2) & (turns_B[:, None] == 2)).long(),
        turn_rewards_B_N=torch.rand(B, 2, generator=generator) * (torch.arange(2) < turns_B[:, None]),
        turn_state_B_N=torch.randint(3, (B, 2), generator=generator).masked_fill(torch.arange(2) >= turns_B[:, None], -1),
    )


def advantages_of(alg, batch):
    return alg.estimate(
        batch["rewards_B_T"], batch["mask_B_T"], group_ids=batch["group_ids"], values_B_T=batch["values_B_T"],
        baselines_B=batch["baselines_B"], old_logp_B_T=batch["old_logp_B_T"], turn_B_T=batch["turn_B_T"],
        teacher_logp_B_T=batch["teacher_logp_B_T"],
        turn_rewards_B_N=batch["turn_rewards_B_N"], turns_B=batch["turns_B"], turn_state_B_N=batch["turn_state_B_N"],
    )


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_runs_without_nan(name):
    alg = get(name).replace(entropy_coef=0.01)
    batch = random_batch()
    adv_B_T, returns_B_T = advantages_of(alg, batch)
    assert torch.isfinite(adv_B_T).all() and torch.isfinite(returns_B_T).all()
    assert (adv_B_T[batch["mask_B_T"] == 0] == 0).all()
    logp_B_T = batch["logp_B_T"].clone().requires_grad_()
    loss, metrics = alg.actor_loss(
        logp_B_T, batch["old_logp_B_T"], adv_B_T, batch["mask_B_T"],
        ref_logp_B_T=batch["ref_logp_B_T"], entropy_B_T=batch["entropy_B_T"],
    )
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert torch.isfinite(logp_B_T.grad).all() and logp_B_T.grad.abs().sum() > 0
    assert all(torch.isfinite(v) and not v.requires_grad for v in metrics.values())


# losses and terms with no preset, on GRPO's advantage (hyperparameters without a default given here)
COMPOSED = {"dro": get("grpo").replace(name="dro", loss="dro", loss_kwargs={"beta": 0.3}),
            "forward_kl": get("grpo_opd").replace(name="forward_kl", forward_kl_coef=0.5, teacher_topk=3)}


# clip_cov and kl_cov pick tokens by statistics of the tensor they see, so they depend on the split by design
@pytest.mark.parametrize("name", sorted(set(TABLE) - {"clip_cov", "kl_cov"}) + sorted(COMPOSED))
def test_preset_gradient_does_not_depend_on_the_micro_batch_split(name):
    alg = COMPOSED[name] if name in COMPOSED else get(name)
    batch = random_batch(seed=1)
    adv_B_T, _ = advantages_of(alg, batch)
    mask_B_T, lengths_B = batch["mask_B_T"], batch["lengths_B"]
    counts = dict(num_tokens=mask_B_T.sum(), num_seqs=len(mask_B_T), norm_length=mask_B_T.shape[1])
    columns = ("logp_B_T", "old_logp_B_T", "ref_logp_B_T")

    def loss_of(logp_B_T, rows, width):
        logp, old, ref = (logp_B_T if c == "logp_B_T" else batch[c] for c in columns)
        distill = {} if not alg.forward_kl_coef else dict(  # the student's top-k log-probs move with logp
            topk_logp_B_T_K=(logp[..., None] + batch["topk_offsets_B_T_K"])[rows, :width],
            teacher_topk_logp_B_T_K=batch["teacher_topk_logp_B_T_K"][rows, :width])
        return alg.actor_loss(
            logp[rows, :width], old[rows, :width], adv_B_T[rows, :width], mask_B_T[rows, :width],
            ref_logp_B_T=ref[rows, :width], **distill, **counts,
        )[0]

    whole_B_T = batch["logp_B_T"].clone().requires_grad_()
    loss_of(whole_B_T, slice(None), mask_B_T.shape[1]).backward()
    parts_B_T = batch["logp_B_T"].clone().requires_grad_()
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss_of(parts_B_T, rows, int(lengths_B[rows].max())).backward()
    assert_close(parts_B_T.grad, whole_B_T.grad)
