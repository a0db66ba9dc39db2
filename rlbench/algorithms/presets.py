"""The named presets: `rlbench.algorithms.get(name)`; and the named rollout corrections (`Algorithm(correction="mis")`,
`names("correction")`). docs/algorithms.md lists both.

A preset lists only what differs from the defaults of its parts (so `get("grpo").replace(loss=my_loss)`
does not hand `my_loss` hyperparameters it never declared). Where a preset follows its paper, the choice
is the paper's setting as run in verl's examples; each is stated in the description.
"""

from __future__ import annotations

from . import advantages, losses, turns  # noqa: F401  (registers the parts named below)
from .correction import Rejection, RolloutCorrection
from .registry import register_algorithm, register_correction

register_algorithm(
    "grpo", advantage="grpo", loss="ppo_clip", reduction="seq-mean-token-mean", kl_coef=0.001,
    description="GRPO (arXiv:2402.03300): group-normalised advantage, PPO clip 0.2, k3 KL loss 0.001.",
)
register_algorithm(
    "dr_grpo", advantage="grpo", loss="ppo_clip", reduction="seq-mean-token-sum-norm",
    advantage_kwargs={"norm_by_std": False},
    description="Dr.GRPO (arXiv:2503.20783): GRPO without std scaling or length normalisation, no KL.",
)
register_algorithm(
    "dapo", advantage="grpo", loss="ppo_clip", loss_kwargs={"clip_high": 0.28, "clip_c": 10.0},
    filter_groups=True, overlong_buffer=0.2, overlong_factor=1.0,
    description="DAPO (arXiv:2503.14476): clip-higher 0.2/0.28, token-mean, dynamic sampling, overlong "
    "shaping (buffer 20% of the max length, factor 1), no KL.",
)
register_algorithm(
    "gspo", advantage="grpo", loss="gspo", reduction="seq-mean-token-mean",
    description="GSPO (arXiv:2507.18071): sequence-ratio clipping, eps 3e-4/4e-4, no KL.",
)
register_algorithm(
    "rloo", advantage="rloo", loss="ppo_clip",
    description="RLOO (arXiv:2402.14740): leave-one-out baseline, PPO clip, token-mean.",
)
register_algorithm(
    "reinforce_pp", advantage="reinforce_plus_plus", loss="ppo_clip", reward_kl_coef=0.001,
    description="REINFORCE++ (arXiv:2501.03262): whitened token returns, fixed k1 KL in the reward (0.001).",
)
register_algorithm(
    "reinforce_pp_baseline", advantage="reinforce_plus_plus_baseline", loss="ppo_clip", reward_kl_coef=0.001,
    description="REINFORCE++ with group baseline (arXiv:2501.03262), fixed k1 KL in the reward (0.001).",
)
register_algorithm(
    "remax", advantage="remax", loss="ppo_clip", needs_greedy_baseline=True,
    description="ReMax (arXiv:2310.10505): greedy-rollout baseline, PPO clip, token-mean.",
)
register_algorithm(
    "ppo", advantage="gae", loss="ppo_clip", needs_critic=True,
    description="PPO (arXiv:1707.06347) with a critic and GAE (gamma 1, lambda 1, verl's defaults).",
)
register_algorithm(
    "cispo", advantage="grpo", loss="cispo",
    description="CISPO (MiniMax-M1, arXiv:2506.13585): clipped IS weight, no lower clip, eps_high 0.2, "
    "token-mean, no KL.",
)
register_algorithm(
    "gmpo", advantage="grpo", loss="gmpo",
    description="GMPO (arXiv:2507.20673): geometric-mean ratio, log-space clip 0.4, sequence mean, no KL.",
)
register_algorithm(
    "sapo", advantage="grpo", loss="sapo",
    description="SAPO (arXiv:2511.20347): sigmoid-gated ratio (tau 1.0/1.05), seq-mean-token-mean, no KL.",
)
register_algorithm(
    "gpg", advantage="gpg", loss="gpg",
    description="GPG (arXiv:2504.02546): rescaled group baseline, plain policy gradient, token-mean, no KL.",
)
register_algorithm(
    "clip_cov", advantage="grpo", loss="clip_cov",
    description="Clip-Cov (arXiv:2505.22617): PPO clip, high-covariance tokens lose their gradient, token-mean.",
)
register_algorithm(
    "kl_cov", advantage="grpo", loss="kl_cov",
    description="KL-Cov (arXiv:2505.22617): KL penalty 0.1 on high-covariance tokens, token-mean.",
)
register_algorithm(
    "opo", advantage="opo", loss="ppo_clip",
    description="OPO (arXiv:2505.23585): length-weighted baseline; the paper trains exactly on-policy "
    "(one optimizer step per batch), token-mean, no KL.",
)
register_algorithm(
    "grpo_passk", advantage="grpo_passk", loss="ppo_clip",
    description="Pass@k GRPO (arXiv:2503.19595): only each group's best sample is reinforced, token-mean.",
)
register_algorithm(
    "dppo", advantage="grpo", loss="dppo_tv", reduction="seq-mean-token-sum-norm",
    advantage_kwargs={"norm_by_std": False},
    description="DPPO (arXiv:2602.04879): total-variation trust region 0.15, ratio cap 20, GRPO advantage "
    "without std, seq-mean-token-sum-norm, no KL (verl's example).",
)
# agentic (multi-turn) tasks only: the estimators read per-turn data (`Algorithm.needs_turns`)
register_algorithm(
    "mt_grpo", advantage="mt_grpo", loss="ppo_clip", reduction="seq-mean-token-mean", kl_coef=0.001,
    description="MT-GRPO (arXiv:2505.11821): GRPO's outcome advantage plus the group-normalised reward of each "
    "turn (turn_coef 1), PPO clip, k3 KL loss 0.001 (GRPO's). Agentic tasks only.",
)
register_algorithm(
    "gigpo", advantage="gigpo", loss="ppo_clip", reduction="seq-mean-token-mean",
    description="GiGPO (arXiv:2505.10978): episode-level GRPO plus step-level advantages over steps that saw the "
    "same environment state (gamma 0.95, step_coef 1), PPO clip, no KL. Agentic tasks only.",
)
register_algorithm(
    "turn_rloo", advantage="turn_rloo", loss="ppo_clip",
    description="RLOO's leave-one-out baseline (arXiv:2402.14740) per turn, unbiased as verl RFC #7244 asks: each "
    "turn's return-to-go minus the mean over the group's other episodes that reached that turn, PPO clip, "
    "token-mean. Agentic tasks only.",
)

# rollout corrections: verl 0.9.1's presets (docs/algo/rollout_corr.md), same thresholds
_MISMATCH_STUDY = ("Liu, Li et al. 2025, \"When Speed Kills Stability: Demystifying RL Collapse from the "
                   "Training-Inference Mismatch\", the study behind verl 0.9.1's rollout correction")
register_correction(
    "token_tis", RolloutCorrection(level="token", mode="tis", high=2.0), verl="decoupled_token_is",
    description="Token-level truncated IS: w_t = min(ρ_t, 2) (TIS: Yao et al. 2025, \"Your efficient RL framework "
    "secretly brings you off-policy RL training\").",
)
register_correction(
    "seq_tis", RolloutCorrection(level="sequence", mode="tis", high=2.0), verl="decoupled_seq_is",
    description="Sequence-level truncated IS: w = min(Π_t ρ_t, 2) on every token of the sequence (TIS: Yao et al. "
    "2025).",
)
register_correction(
    "icepop", RolloutCorrection(level="token", mode="mask", low=0.5, high=5.0),
    verl='rollout_is=token, rollout_is_threshold="0.5_5.0"',
    description="IcePop (Ring-1T report, arXiv:2510.18855): token weights w_t = ρ_t·1[0.5 ≤ ρ_t ≤ 5], 0 outside the "
    "band (α = 0.5, β = 5 as in the report).",
)
register_correction(
    "mis", RolloutCorrection(level="sequence", mode="tis", high=2.0,
                             reject=(Rejection("k1", "seq_sum", low=0.5, high=2.0),)),
    verl='decoupled_seq_is_rs (rollout_is=sequence, rollout_rs=seq_sum_k1 "0.5_2.0")',
    description="MIS, sequence IS with rejection: w = min(Π_t ρ_t, 2), and a sequence is dropped unless its k1 sum "
    f"-Σ_t log ρ_t lies in [log 0.5, log 2] ({_MISMATCH_STUDY}).",
)
register_correction(
    "geo_reject", RolloutCorrection(mode=None, reject=(Rejection("k1", "seq_mean", low=0.999, high=1.001),)),
    verl='decoupled_geo_rs (rollout_rs=seq_mean_k1 "0.999_1.001")',
    description="Geometric-mean rejection: no IS weights; a sequence is dropped unless -mean_t log ρ_t lies in "
    "[log 0.999, log 1.001], i.e. its geometric-mean ratio exp(mean_t log ρ_t) lies in [1/1.001, 1/0.999] "
    f"({_MISMATCH_STUDY}).",
)

# bypass mode: after the corrections, which grpo_bypass_pg names
register_algorithm(
    "grpo_bypass", advantage="grpo", loss="ppo_clip", reduction="seq-mean-token-mean", kl_coef=0.001, bypass="ppo_clip",
    description="GRPO (arXiv:2402.03300) in verl 0.9.1's bypass mode (preset bypass_ppo_clip): the sampler's "
    "log-probs are PPO's old policy, no old-policy forward; the clip ratio is pi_theta/pi_sampler, no IS weights.",
)
register_algorithm(
    "grpo_bypass_pg", advantage="grpo", loss="gpg", reduction="seq-mean-token-mean", kl_coef=0.001,
    bypass="reinforce", correction="token_tis",
    description="GRPO's advantage (arXiv:2402.03300) in verl 0.9.1's bypass mode, REINFORCE variant: L = "
    "-A·logp·w, w = min(pi_theta/pi_sampler, 2) per token (truncated IS), no old-policy forward.",
)

# on-policy distillation (rlbench/algorithms/distill.py): a session with teacher=...
register_algorithm(
    "opd", advantage="reverse_kl", loss="ppo_clip",
    description="On-policy distillation (GKD arXiv:2306.13649; Thinking Machines 2025; Qwen3 arXiv:2505.09388): "
    "the student's samples, A_t = -(logπ_student - logπ_teacher) per token (k1), PPO clip, token-mean; no task "
    "reward. Needs teacher=.",
)
register_algorithm(
    "grpo_opd", advantage="grpo", loss="ppo_clip", reduction="seq-mean-token-mean", distill_coef=1.0,
    description="GRPO (arXiv:2402.03300) plus on-policy distillation: the group-normalised task advantage plus "
    "1.0·(-(logπ_student - logπ_teacher)) per token (k1); the teacher's KL replaces the reference's. Needs teacher=.",
)
