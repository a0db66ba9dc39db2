"""The one forward pass every model of the trainer shares: token log-probs of a Batch's responses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbench.batch import Batch


def response_outputs(model, batch: Batch) -> torch.Tensor:
    """The model's outputs at the positions that predict each response token, `[B, T, F]` in fp32.

    The sequence is prompt (left-padded) + response (right-padded); position ids count real tokens, so
    every row sees the positions it had in the sampler. For a causal LM F is the vocabulary (logits);
    for a critic's value head F is 1 (the value of the state before each token).
    """
    ids_B_L = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    mask_B_L = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    position_B_L = (mask_B_L.cumsum(-1) - 1).clamp(min=0)
    P, T = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    out_B_L_F = model(input_ids=ids_B_L, attention_mask=mask_B_L, position_ids=position_B_L, use_cache=False).logits
    return out_B_L_F[:, P - 1 : P + T - 1].float()  # position P-1 predicts response token 0


def response_logits(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logits `[B, T, V]` of each response token, scaled by 1/temperature (temperature 0, greedy: unscaled)."""
    logits_B_T_V = response_outputs(model, batch)
    return logits_B_T_V / temperature if temperature > 0 else logits_B_T_V


def token_logp(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[id] without materialising the whole log-softmax."""
    return logits_B_T_V.gather(-1, ids_B_T[..., None]).squeeze(-1) - logits_B_T_V.logsumexp(-1)


@torch.no_grad()
def batch_logp(model, batch: Batch, *, temperature: float, micro_batch_tokens: int,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """Log-probs of every response token of `batch`, `[B, T]` on CPU (0 on padding), in micro-batches."""
    logp_B_T = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
    start = 0
    for micro in rank_micro_batches(batch, micro_batch_tokens):
        micro = micro.trimmed().to(device)
        logits_b_t_V = response_logits(model, micro, temperature)
        width = logits_b_t_V.shape[1]
        logp_B_T[start : start + len(micro), :width] = token_logp(logits_b_t_V, micro["response_ids"]).cpu()
        start += len(micro)
    return logp_B_T * batch["response_mask"]


def micro_batches(batch: Batch, micro_batch_tokens: int) -> list[Batch]:
    """Consecutive rows packed so that rows x padded length stays within `micro_batch_tokens`.

    A single row longer than the budget gets a micro-batch of its own.
    """
    prompt_len = batch["prompt_mask"].sum(-1).tolist()
    response_len = batch["response_mask"].sum(-1).tolist()
    chunks, start, widest_p, widest_r = [], 0, 0, 0
    for i, (p, r) in enumerate(zip(prompt_len, response_len)):
        wp, wr = max(widest_p, p), max(widest_r, r)
        if i > start and (i - start + 1) * (wp + wr) > micro_batch_tokens:
            chunks.append(batch[start:i])
            start, wp, wr = i, p, r
        widest_p, widest_r = wp, wr
    if len(batch):
        chunks.append(batch[start:])
    return chunks


def rank_micro_batches(batch: Batch, micro_batch_tokens: int) -> list[Batch]:
    """`micro_batches`, with the same count on every rank of the process group.

    FSDP2 gathers parameters collectively at every forward, so all ranks must run the same number of
    forwards: a rank that needs fewer micro-batches than the busiest one splits its rows more finely.
    """
    chunks = micro_batches(batch, micro_batch_tokens)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return chunks
    count = torch.tensor([len(chunks)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return chunks if len(chunks) == int(count) else batch.chunk(int(count))
