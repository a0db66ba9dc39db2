"""A step's row of `Session.metrics`: summaries of the batch it trained on (and of its episodes, when agentic)."""

from __future__ import annotations

import torch

from rlbench.algorithms import masked_mean, mismatch_metrics, to_float
from rlbench.batch import Batch


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Per-step summaries of a scored, advantaged batch (and its whole-batch numeric `meta` values). The
    sampler-vs-trainer mismatch (`sampler_mismatch_*`, `sampler_kl*`, `sampler_ratio_*`) is here when the batch
    has `old_logp`; with `on_policy_old_logp` the update's forward reports it. With a teacher, `teacher_kl`: the mean
    of `logπ_student - logπ_teacher` over sampled tokens (k1 of the reverse KL that distillation lowers)."""
    mask_B_T = batch["response_mask"].float()
    sampled_B_T = batch.tensors.get("loss_mask", batch["response_mask"]).float()  # episodes: sampled tokens only
    valid = sampled_B_T.sum().clamp(min=1)
    mismatch = {}
    if "old_logp" in batch:
        mismatch = {k: to_float(v) for k, v in mismatch_metrics(batch["old_logp"], batch["sampler_logp"], sampled_B_T).items()}
    if "teacher_logp" in batch:  # on-policy distillation: the reverse KL to the teacher per sampled token (k1)
        student_B_T = batch.tensors.get("old_logp", batch["sampler_logp"])
        mismatch["teacher_kl"] = to_float(masked_mean(student_B_T - batch["teacher_logp"], sampled_B_T))
    return {
        "reward_mean": to_float(batch["reward"].mean()),
        "reward_std": to_float(batch["reward"].std()) if len(batch) > 1 else 0.0,
        "score_mean": to_float(batch["score"].mean()),
        "accuracy": to_float(accuracy(batch).mean()),
        "reward_errors": float(sum(e is not None for e in batch["reward_error"])),
        "response_length": to_float(mask_B_T.sum(-1).mean()),
        "truncated_frac": to_float((~batch["finished"]).float().mean()),
        "advantage_abs_mean": to_float((batch["advantages"].abs() * sampled_B_T).sum() / valid),
    } | mismatch | (episode_metrics(batch) if "turns" in batch else {}) | {k: float(v) for k, v in batch.meta.items() if isinstance(v, (int, float))}


def accuracy(batch: Batch) -> torch.Tensor:
    """Per-sample accuracy: the reward's "acc" component when it has one, else the task's score."""
    return batch["acc"] if "acc" in batch else batch["score"]


def episode_metrics(batch: Batch) -> dict[str, float]:
    """Agentic episodes: turns, sampled tokens, tool calls, the share of calls that gave a result, and how
    episodes ended (`ended_<reason>`: the share of each stop reason)."""
    calls = float(batch["tool_calls"].sum())
    reasons = batch["stop_reason"]
    return {
        "turns_mean": to_float(batch["turns"].float().mean()),
        "sampled_length": to_float(batch["loss_mask"].sum(-1).float().mean()),
        "tool_calls_mean": to_float(batch["tool_calls"].float().mean()),
        "tool_errors_mean": to_float(batch["tool_errors"].float().mean()),
        "tool_success_rate": 1.0 - float(batch["tool_errors"].sum()) / calls if calls else 0.0,
    } | {f"ended_{r}": reasons.count(r) / len(reasons) for r in sorted(set(reasons))}
