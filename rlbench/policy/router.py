"""A mixture-of-experts policy's routing, as seen by the training forward: each router's choices at the positions
whose outputs the loss reads, summed up per step in the metrics (`RouterStats`)."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers: transformers' `...TopKRouter` modules (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE...), whose
    forward returns (router logits `[N, E]`, the chosen experts' weights, their ids `[N, k]`). Empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class RouterStats:
    """Records each router's logits and choices during the forwards it is active for (forward hooks, removed by
    `close()`), at the positions the forward reports as read (`at`: the flat layout positions that predict the
    response tokens, set by `rlbench.policy.forward`), and sums them up per micro-batch (`metrics`)."""

    def __init__(self, model: nn.Module):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.at: torch.Tensor | None = None
        self.recording = False
        """Whether a forward now is one to record (not a recomputation in the backward, not another model's)."""
        self.hooks = [router.register_forward_hook(self._record) for router in routers(model)]

    def _record(self, _module, _inputs, output) -> None:
        if self.recording:
            logits_N_E, _, experts_N_K = output
            self.layers.append((logits_N_E.detach(), experts_N_K.detach()))

    def metrics(self, mask_B_T: torch.Tensor) -> dict[str, torch.Tensor]:
        """The routing at the response positions `mask_B_T` of the last forward, averaged over layers (and cleared):

        - `router_entropy`: the mean entropy (nats) of a token's router distribution (ln E: uniform; 0: certain);
        - `router_load_max` / `router_load_min`: the largest and smallest share of the top-k choices an expert gets
          (1/E each when balanced);
        - `router_imbalance`: E x the largest share (1: balanced; E: every choice to one expert);
        - `router_aux_loss`: the load-balancing loss of Switch Transformer and Qwen-MoE, E x sum_e f_e P_e (f_e: the
          expert's share of the choices, P_e: its mean router probability; 1 when balanced), reported, not trained on.
        """
        if not self.layers or self.at is None:
            raise RuntimeError("RouterStats.metrics: no forward was recorded with its positions (`at`)")
        positions_M = self.at[mask_B_T.bool()]
        sums = dict.fromkeys(("router_entropy", "router_load_max", "router_load_min", "router_imbalance",
                              "router_aux_loss"), 0.0)
        for logits_N_E, experts_N_K in self.layers:
            logp_M_E = torch.log_softmax(logits_N_E[positions_M].float(), -1)
            E = logp_M_E.shape[-1]
            load_E = torch.bincount(experts_N_K[positions_M].reshape(-1), minlength=E).float()
            load_E = load_E / load_E.sum().clamp(min=1)
            sums["router_entropy"] += float(-(logp_M_E.exp() * logp_M_E).sum(-1).mean())
            sums["router_load_max"] += float(load_E.max())
            sums["router_load_min"] += float(load_E.min())
            sums["router_imbalance"] += float(load_E.max()) * E
            sums["router_aux_loss"] += E * float((load_E * logp_M_E.exp().mean(0)).sum())
        layers = len(self.layers)
        self.layers, self.at = [], None
        return {name: torch.tensor(value / layers) for name, value in sums.items() if not math.isnan(value)}

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


@contextmanager
def recording(stats: RouterStats | None):
    """`stats` records the forwards run inside (nothing with None)."""
    if stats is None:
        yield
        return
    stats.recording = True
    try:
        yield
    finally:
        stats.recording = False
