"""A step's row of `Session.metrics`: summaries of the batch it trained on (and of its episodes, when agentic)."""

from __future__ import annotations

from collections import Counter

import torch

from rlbench.algorithms import masked_mean, mismatch_metrics, to_float
from rlbench.batch import Batch
from rlbench.policy.fsdp import loss_mask
from rlbench.rewards.answers import extract_gsm8k


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Per-step summaries of a scored, advantaged batch (and its whole-batch numeric `meta` values). The
    sampler-vs-trainer mismatch (`sampler_mismatch_*`, `sampler_kl*`, `sampler_ratio_*`) is here when the batch
    has `old_logp`; with `on_policy_old_logp` the update's forward reports it. With a teacher, `teacher_kl`: the mean
    of `logπ_student - logπ_teacher` over sampled tokens (k1 of the reverse KL that distillation lowers)."""
    mask_B_T = batch["response_mask"].float()
    sampled_B_T = loss_mask(batch)  # an episode's: its sampled tokens only
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


def at_k(batch: Batch, prompts: int) -> dict[str, float]:
    """pass@k and maj@k of a scored batch of k samples for each of `prompts` prompts (group ids 0..prompts-1).

    A sample is correct when its accuracy is above 0; its answer is the last number of its completion (the text
    itself when it has none). See `pass_and_majority`."""
    correct: list[list[bool]] = [[] for _ in range(prompts)]
    answers: list[list[str]] = [[] for _ in range(prompts)]
    for ok, group, text in zip((accuracy(batch) > 0).tolist(), batch["group_ids"].tolist(), batch["completion"]):
        correct[group].append(ok)  # one pass over the samples, grouped by prompt
        answers[group].append(extract_gsm8k(text, "flexible") or text.strip())
    k = len(batch) // prompts
    return dict(zip((f"pass@{k}", f"maj@{k}"), pass_and_majority(correct, answers)))


def pass_and_majority(correct: list[list[bool]], answers: list[list[str]]) -> tuple[float, float]:
    """(pass@k, maj@k) from each prompt's k samples: whether each is correct, and its final answer.

    pass@k: a prompt counts when any sample is correct. maj@k: the most frequent answer (the first of those
    tied) is scored; it is correct when the samples giving it are.
    """
    passed = sum(any(c) for c in correct)
    majority = 0
    for c, a in zip(correct, answers):
        winner = Counter(a).most_common(1)[0][0]
        majority += c[a.index(winner)]
    return passed / len(correct), majority / len(correct)


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


def alarms(batch: Batch, what: str, max_new_tokens: int) -> dict[str, str]:
    """What a batch says is wrong with the run's settings, by kind, each message starting with `what` ("step 3"):
    most completions cut at the token limit (agentic: more episodes ended on a turn cut there than tool calls gave a
    result: a cut call is lost), or, for a batch with advantages, all of them 0 (no sample's score
    differed from its group's: the policy-gradient term trains on nothing)."""
    found = {}
    if "turns" in batch:
        cut = sum(r == "max_tokens" for r in batch["stop_reason"])
        results = int(batch["tool_calls"].sum() - batch["tool_errors"].sum())
        if cut > results:
            found["max_new_tokens"] = (
                f"{what}: {cut} of {len(batch)} episodes ended on a turn cut at max_new_tokens={max_new_tokens} (per "
                f"turn), against {results} tool calls that gave a result: a cut call is lost. Raise max_new_tokens")
    elif (cut := to_float((~batch["finished"]).float().mean())) > 0.5:
        found["max_new_tokens"] = (f"{what}: {cut:.0%} of the completions were cut at max_new_tokens={max_new_tokens}, "
                                   f"before EOS: their rewards score unfinished text. Raise max_new_tokens")
    if "advantages" in batch and not batch["advantages"].abs().sum():
        found["advantages"] = (
            f"{what}: every advantage is 0 (each group's samples scored alike): the update's policy-gradient term "
            f"trained on nothing. The task may be too hard or too easy for the model, or its reward constant")
    return found
