"""A mixture-of-experts policy's routing, as seen by the training forward: each router's choices at the positions
whose outputs the loss reads, summed up per step in the metrics (`RouterStats`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

METRICS = ("router_entropy", "router_load_max", "router_load_min", "router_imbalance", "router_aux_loss")
"""What `layer_stats` computes, in its order (see there)."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers: transformers' `...TopKRouter` modules (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE...), whose
    forward returns (router logits `[N, E]`, the chosen experts' weights, their ids `[N, k]`). Empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def layer_stats(logits_M_E: torch.Tensor, experts_M_K: torch.Tensor) -> torch.Tensor:
    """`[5]`, one router's routing of M tokens (`METRICS`' order):

    - `router_entropy`: the mean entropy (nats) of a token's router distribution (ln E: uniform; 0: certain);
    - `router_load_max` / `router_load_min`: the largest and smallest share of the top-k choices an expert gets
      (1/E each when balanced);
    - `router_imbalance`: E x the largest share (1: balanced; E: every choice to one expert);
    - `router_aux_loss`: the load-balancing loss of Switch Transformer and Qwen-MoE, E x sum_e f_e P_e (f_e: the
      expert's share of the choices, P_e: its mean router probability; 1 when balanced), reported, not trained on.
    """
    logp_M_E = torch.log_softmax(logits_M_E.float(), -1)
    E = logp_M_E.shape[-1]
    load_E = torch.bincount(experts_M_K.reshape(-1), minlength=E).float()
    load_E = load_E / load_E.sum()
    p_M_E = logp_M_E.exp()
    return torch.stack([-(p_M_E * logp_M_E).sum(-1).mean(), load_E.max(), load_E.min(), E * load_E.max(),
                        E * (load_E * p_M_E.mean(0)).sum()])


class RouterStats:
    """Each router's `layer_stats` during the forwards it records (`recording`; forward hooks, removed by `close()`), at
    the response positions: the flat layout positions that predict the response tokens (`at`, set by
    `rlbench.policy.forward`) where the micro-batch's response mask is 1. Only those five numbers per layer are kept;
    `metrics` averages them over layers."""

    def __init__(self, model: nn.Module):
        self.layers: list[torch.Tensor] = []
        self.at: torch.Tensor | None = None
        self.mask_B_T: torch.Tensor | None = None
        """The response mask of the micro-batch being recorded (None: not recording, as in a recomputation in the
        backward, or another forward of the model)."""
        self.hooks = [router.register_forward_hook(self._record) for router in routers(model)]

    def _record(self, _module, _inputs, output) -> None:
        if self.mask_B_T is None or self.at is None:
            return
        logits_N_E, _, experts_N_K = output
        positions_M = self.at[self.mask_B_T.bool()]
        if len(positions_M):
            self.layers.append(layer_stats(logits_N_E.detach()[positions_M], experts_N_K[positions_M]))

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last recorded forward's routing, averaged over layers, and cleared; {} where it read no response token."""
        stats = torch.stack(self.layers).mean(0) if self.layers else None
        self.layers, self.at = [], None
        return {} if stats is None else dict(zip(METRICS, stats))

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


@contextmanager
def recording(stats: RouterStats | None, mask_B_T: torch.Tensor):
    """`stats` records the forwards run inside, at the response tokens of `mask_B_T` (nothing with None)."""
    if stats is None:
        yield
        return
    stats.mask_B_T = mask_B_T
    try:
        yield
    finally:
        stats.mask_B_T = None
