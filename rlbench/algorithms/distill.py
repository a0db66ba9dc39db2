"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens.

Agarwal et al., On-Policy Distillation of Language Models (GKD), arXiv:2306.13649; Thinking Machines, "On-Policy
Distillation" (2025); the Qwen3 technical report, arXiv:2505.09388; verl 0.9.1's distillation losses. Three pieces,
each composable with RL:

- `reverse_kl` (an advantage estimator): `A_t = -k(logπ_student, logπ_teacher)` on the sampled tokens, the
  per-token reverse KL as a reward to every token (no discounting across tokens), trained with the algorithm's
  policy-gradient loss. Pure distillation: preset `opd`.
- `Algorithm.distill_coef`: the same per-token term added, times the coefficient, to any estimator's advantages:
  task reward plus distillation (preset `grpo_opd`).
- `Algorithm.forward_kl_coef`: the forward KL to the teacher's top-k distribution as a supervised loss term
  (`core.forward_kl_topk`), the student's log-probs gathered at the teacher's `teacher_topk` most likely tokens.

The tensor math (`reverse_kl_advantages`, `teacher_topk`, `forward_kl_topk`) lives in `core`.
"""

from __future__ import annotations

from .core import reverse_kl_advantages
from .registry import register_advantage


@register_advantage("reverse_kl", verl="distillation_loss.use_policy_gradient=true, loss_mode=k1 (or k3)")
def reverse_kl(rewards_B_T, mask_B_T, *, old_logp_B_T=None, teacher_logp_B_T=None, estimator: str = "k1"):
    """On-policy distillation (GKD arXiv:2306.13649; Thinking Machines 2025): the negative per-token reverse KL
    from the student to the teacher, on the student's own samples, is each token's advantage; the task's reward
    is not used.

        A_t = -k(logπ_old_t, logπ_teacher_t)·m_t,   k = k1 (logπ_s - logπ_t) or k3;   returns = A

    Differs from the RL estimators by reading no reward: a dense per-token signal from the teacher, each token
    credited with its own term only (no sum over later tokens, as Thinking Machines' recipe). Needs
    `teacher_logp_B_T` (a session with `teacher=`) and `old_logp_B_T`."""
    if old_logp_B_T is None or teacher_logp_B_T is None:
        raise ValueError("reverse_kl needs teacher_logp_B_T (a session with teacher=...) and old_logp_B_T")
    advantages_B_T = reverse_kl_advantages(old_logp_B_T, teacher_logp_B_T, mask_B_T, estimator)
    return advantages_B_T, advantages_B_T
