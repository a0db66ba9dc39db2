"""The algorithm zoo: advantage estimators, policy losses, reductions, KL, presets, as pure tensor functions.

    import rlbench.algorithms as A
    A.names()                              # presets; A.names("loss"), A.names("advantage"), A.names("correction")
    alg = A.get("dapo")                    # an Algorithm: parts + hyperparameters + what the step needs
    print(A.describe("gspo"))              # formula, paper, hyperparameters

    @A.register_loss("my_loss")
    def my_loss(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, beta=0.1): ...
    mine = A.get("grpo").replace(name="mine", loss=my_loss)
    A.get("grpo").replace(correction="mis")  # rollout correction: a name, or A.RolloutCorrection(...)

docs/algorithms.md lists every part with its formula, source and verl name; `python -m rlbench.algorithms.reference`
writes it from the registry. This package imports only torch and the standard library.
"""

import importlib
import pkgutil

from .core import (
    KL_KINDS,
    REDUCTIONS,
    AdaptiveKL,
    aggregate,
    entropy_from_logits,
    outcome_rewards,
    forward_kl_topk,
    ratio,
    reverse_kl_advantages,
    teacher_topk,
    to_float,
    token_logp,
    token_logp_and_sum_pi2,
    kl,
    kl_in_reward,
    masked_mean,
    masked_var,
    masked_whiten,
    value_loss,
)
from .correction import Rejection, RolloutCorrection, mismatch_metrics
from .registry import (
    ADVANTAGE_DATA,
    ADVANTAGE_INPUTS,
    BYPASS_MODES,
    LOSS_DATA,
    Algorithm,
    advantage_fn,
    declared,
    describe,
    get,
    get_correction,
    hyperparameters,
    input_provider,
    loss_fn,
    loss_reduction,
    names,
    register_advantage,
    register_advantage_input,
    register_algorithm,
    register_correction,
    register_loss,
)
from .sampling import filter_groups, longest_turns, overlong_penalty

__all__ = [
    "ADVANTAGE_DATA",
    "ADVANTAGE_INPUTS",
    "BYPASS_MODES",
    "LOSS_DATA",
    "KL_KINDS",
    "REDUCTIONS",
    "AdaptiveKL",
    "Algorithm",
    "Rejection",
    "RolloutCorrection",
    "advantage_fn",
    "aggregate",
    "declared",
    "describe",
    "entropy_from_logits",
    "filter_groups",
    "forward_kl_topk",
    "get",
    "get_correction",
    "hyperparameters",
    "input_provider",
    "kl",
    "kl_in_reward",
    "longest_turns",
    "loss_fn",
    "loss_reduction",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "names",
    "outcome_rewards",
    "overlong_penalty",
    "ratio",
    "register_advantage",
    "register_advantage_input",
    "register_algorithm",
    "register_correction",
    "register_loss",
    "reverse_kl_advantages",
    "teacher_topk",
    "to_float",
    "token_logp",
    "token_logp_and_sum_pi2",
    "value_loss",
]

# Every module of this package registers its parts on import: a new algorithm is one new file here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
