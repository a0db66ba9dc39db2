"""The one forward pass every model of the trainer shares: token log-probs of a Batch's responses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbench.batch import Batch


PACK_WIDTH = 32
"""Packed rows hold at least this many tokens (more when one sequence is longer)."""


def response_outputs(model, batch: Batch) -> torch.Tensor:
    """The model's outputs at the positions that predict each response token, `[B, T, F]` in fp32.

    Each row's real tokens (the prompt without its left padding, then the response without its right
    padding) are packed back to back into rows of `max(PACK_WIDTH, longest sequence)` tokens, with
    position ids counting from 0 in every sequence, so every row sees the positions it had in the sampler
    and no compute goes to padding. Without an attention mask, transformers reads sequence boundaries
    from the position ids and attends only within a sequence (its packed-sequence mask). For a causal LM
    F is the vocabulary (logits); for a critic's value head F is 1 (the value of the state before each
    token). Outputs past a row's last response token are those of other positions: mask them.
    """
    ids_B_L = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    mask_B_L = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).bool()
    position_B_L = mask_B_L.cumsum(-1) - 1
    length_B = mask_B_L.sum(-1)
    width = max(PACK_WIDTH, int(length_B.max()))
    offsets, packed_row, used = [], 0, 0  # where each sequence starts in the flattened packed rows
    for n in length_B.tolist():
        if used + n > width:
            packed_row, used = packed_row + 1, 0
        offsets.append(packed_row * width + used)
        used += n
    offset_B = torch.tensor(offsets, device=ids_B_L.device)
    slot_B_L = offset_B[:, None] + position_B_L
    ids_N = ids_B_L.new_zeros((packed_row + 1) * width)  # padding slots: token 0 at position 0, alone
    position_N = torch.zeros_like(ids_N)
    ids_N[slot_B_L[mask_B_L]] = ids_B_L[mask_B_L]
    position_N[slot_B_L[mask_B_L]] = position_B_L[mask_B_L]
    out_R_W_F = model(input_ids=ids_N.view(-1, width), position_ids=position_N.view(-1, width), use_cache=False).logits
    # the last prompt token predicts response token 0
    T = batch["response_ids"].shape[1]
    first_B = offset_B + batch["prompt_mask"].sum(-1) - 1
    slot_B_T = (first_B[:, None] + torch.arange(T, device=first_B.device)).clamp(max=len(ids_N) - 1)
    return out_R_W_F.flatten(0, 1)[slot_B_T].float()


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
