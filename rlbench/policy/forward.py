"""The one forward pass every model of the trainer shares: token log-probs of a Batch's responses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbench.batch import Batch


PACK_WIDTH = 64
"""Packed rows are a whole number of the longest prompt group's lengths, at least this many tokens."""


def response_outputs(model, batch: Batch) -> torch.Tensor:
    """The model's outputs at the positions that predict each response token, `[B, T, F]` in fp32.

    No compute goes to padding, nor to a prompt more than once: consecutive rows with the same prompt (a
    group of samples) are laid out as the prompt's real tokens once, then each row's real response tokens,
    and groups are packed back to back into rows of about `PACK_WIDTH` tokens (see there). A 4D mask
    lets a prompt token attend to the prompt causally and a response token to its prompt and, causally, to
    its own response; position ids are those each row had in the sampler (the prompt's real tokens count
    from 0, the response continues). So every response token sees exactly the context it had unpacked (the
    same math; the shared prompt's gradient is the sum over its samples). For a causal LM F is the
    vocabulary (logits); for a critic's value head F is 1 (the value of the state before each token).
    Outputs past a row's last response token are those of other positions: mask them.
    """
    ids_N, position_N, allowed_R_W_W, slot_B_T = _pack_groups(batch)
    R, W, _ = allowed_R_W_W.shape
    bias_R_1_W_W = torch.zeros((R, 1, W, W), device=ids_N.device).masked_fill_(
        ~allowed_R_W_W[:, None], torch.finfo(torch.float32).min)
    out_R_W_F = model(input_ids=ids_N.view(R, W), position_ids=position_N.view(R, W), attention_mask=bias_R_1_W_W,
                      use_cache=False).logits
    return out_R_W_F.flatten(0, 1)[slot_B_T].float()


def _pack_groups(batch: Batch):
    """The shared-prompt layout of `response_outputs`: token ids and position ids `[N]` (N = R·W slots),
    which slot may attend to which `[R, W, W]`, and the slot whose output predicts each response token
    `[B, T]`. Padding slots hold token 0 and attend only to themselves."""
    prompt_ids_B_P, prompt_mask_B_P = batch["prompt_ids"], batch["prompt_mask"].bool()
    response_ids_B_T, response_mask_B_T = batch["response_ids"], batch["response_mask"].bool()
    (B, T), device = response_ids_B_T.shape, response_ids_B_T.device
    new_group_B = torch.ones(B, dtype=torch.bool, device=device)
    new_group_B[1:] = ((prompt_ids_B_P[1:] != prompt_ids_B_P[:-1]) | (prompt_mask_B_P[1:] != prompt_mask_B_P[:-1])).any(-1)
    group_B = new_group_B.cumsum(0) - 1
    first_G = new_group_B.nonzero().squeeze(-1)  # each group's first row
    prompt_len_B, response_len_B = prompt_mask_B_P.sum(-1), response_mask_B_T.sum(-1)
    before_B = response_len_B.cumsum(0) - response_len_B
    within_B = before_B - before_B[first_G][group_B]  # response tokens of earlier rows of the same group
    group_len_G = prompt_len_B[first_G] + torch.zeros_like(first_G).index_add_(0, group_B, response_len_B)
    longest = int(group_len_G.max())
    W = longest * -(-PACK_WIDTH // longest)
    offsets, row, used = [], 0, 0  # groups back to back, a group never split across rows
    for n in group_len_G.tolist():
        if used + n > W:
            row, used = row + 1, 0
        offsets.append(row * W + used)
        used += n
    offset_G = torch.tensor(offsets, device=device)
    N = (row + 1) * W
    ids_N, position_N = (torch.zeros(N, dtype=torch.long, device=device) for _ in range(2))
    group_N, segment_N = (-1 - torch.arange(N, device=device) for _ in range(2))  # padding: its own group
    is_prompt_N = torch.zeros(N, dtype=torch.bool, device=device)
    # each group's prompt, once: segment B + g
    prompt_mask_G_P = prompt_mask_B_P[first_G]
    position_G_P = prompt_mask_G_P.cumsum(-1) - 1
    slots = (offset_G[:, None] + position_G_P)[prompt_mask_G_P]
    g_G_P = torch.arange(len(first_G), device=device)[:, None].expand_as(position_G_P)
    ids_N[slots] = prompt_ids_B_P[first_G][prompt_mask_G_P]
    position_N[slots] = position_G_P[prompt_mask_G_P]
    group_N[slots], segment_N[slots], is_prompt_N[slots] = g_G_P[prompt_mask_G_P], B + g_G_P[prompt_mask_G_P], True
    # each row's response after its group's prompt and the earlier rows' responses: segment = the row
    t_1_T = torch.arange(T, device=device)[None]
    slot_B_T = (offset_G[group_B] + prompt_len_B + within_B)[:, None] + t_1_T
    slots = slot_B_T[response_mask_B_T]
    ids_N[slots] = response_ids_B_T[response_mask_B_T]
    position_N[slots] = (prompt_len_B[:, None] + t_1_T).expand(B, T)[response_mask_B_T]
    group_N[slots] = group_B[:, None].expand(B, T)[response_mask_B_T]
    segment_N[slots] = torch.arange(B, device=device)[:, None].expand(B, T)[response_mask_B_T]
    # same group, not later, and the same segment or a prompt token
    group_R_W, segment_R_W, is_prompt_R_W = group_N.view(-1, W), segment_N.view(-1, W), is_prompt_N.view(-1, W)
    allowed_R_W_W = ((group_R_W[:, :, None] == group_R_W[:, None, :])
                     & torch.ones(W, W, dtype=torch.bool, device=device).tril()
                     & ((segment_R_W[:, :, None] == segment_R_W[:, None, :]) | is_prompt_R_W[:, None, :]))
    # response token 0 is predicted by the group's last prompt token, token t by the row's token t-1
    last_prompt_B = offset_G[group_B] + prompt_len_B - 1
    predictor_B_T = torch.cat([last_prompt_B[:, None], slot_B_T[:, :-1]], dim=1).clamp(max=N - 1)
    return ids_N, position_N, allowed_R_W_W, predictor_B_T


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
