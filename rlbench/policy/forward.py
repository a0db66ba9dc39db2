"""The one forward pass every model of the trainer shares: token log-probs of a Batch's responses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlbench.algorithms import entropy_from_logits, teacher_topk, token_logp, token_logp_and_sum_pi2
from rlbench.batch import Batch
from rlbench.models.vision import NEVER_LOGIT, forward_inputs, image_inputs, never_sampled, same_images
from rlbench.policy.router import RouterStats


PACK_WIDTH = 64
"""Packed rows are a whole number of the longest group's length, up to twice this many tokens (see `_pack`)."""


ATTENTION = ("auto", "packed", "per_sample")
"""How `response_outputs` lays a batch out for attention (see there)."""
PACKED_MASK_BYTES = 64 * 2**20
"""`attention="auto"` packs only while the packed layout's additive mask may take at most this many bytes."""
PAIRS_PER_TOKEN = 4
"""`attention="auto"`'s cost model: one token's projections and MLP cost about as much as attending over
PAIRS_PER_TOKEN x hidden_size query-key pairs (measured on tiny-arith, hidden size 192, forward + backward
on one CPU thread: about 800 pairs per token)."""
MASKED_ATTENTION = ("eager", "sdpa")
"""Attention implementations that honour the packed layout's 4-D additive mask (flash attention ignores it)."""
LOGIT_CHUNK_TOKENS = 4096
"""`logit_chunk_tokens=None` (auto) chunks by this many tokens where a micro-batch's fp32 logits would take more
than `LOGIT_BYTES`."""
LOGIT_BYTES = 2**30


def chunk_tokens_for(setting: int | None, micro_batch_tokens: int, vocab: int) -> int:
    """The chunk `setting` (`Config.logit_chunk_tokens`) asks for: N > 0 itself, 0 none; None: `LOGIT_CHUNK_TOKENS`
    where a micro-batch's fp32 logits (micro_batch_tokens x vocab x 4 bytes) would take more than `LOGIT_BYTES`,
    else none."""
    if setting is not None:
        if setting < 0:
            raise ValueError(f"logit_chunk_tokens={setting}: give a number of tokens > 0, 0 (off) or None (auto)")
        return setting
    return LOGIT_CHUNK_TOKENS if micro_batch_tokens * vocab * 4 > LOGIT_BYTES else 0


def response_outputs(model, batch: Batch, attention: str = "auto",
                     head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     router: RouterStats | None = None) -> torch.Tensor:
    """The model's outputs at the positions that predict each response token, `[B, T, F]` in fp32; with `head`,
    what `head` makes of the hidden states there, `[B·T, H]` -> `[B·T, F]`, in place of the output embedding's
    logits (`response_stats`).

    For a causal LM F is the vocabulary (logits); for a critic's value head F is 1 (the value of the state
    before each token). Outputs past a row's last response token are those of other positions: mask them.
    Two layouts compute the same numbers (to float rounding), and "auto" chooses between them:

    - "packed" (`_packed_outputs`): each prompt and each shared response prefix once, groups packed into
      rows of width W, through a dense R x W x W mask. The least compute when responses are short, but its
      memory and attention grow with W², and W grows with a group's summed response lengths.
    - "per_sample" (`_per_sample_outputs`): each row on its own (prompt, then response), causal attention
      with no mask tensor: memory linear in the sequence length (with "sdpa" or flash attention).
    - "auto": "packed" where it pays (`packing_pays`: many short responses to a shared prompt), else
      "per_sample".

    `router`: a mixture-of-experts model's `RouterStats`, told which positions of the layout predict the responses.
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of: {', '.join(map(repr, ATTENTION))}")
    implementation = model.config._attn_implementation
    if attention == "packed" and implementation not in MASKED_ATTENTION:
        raise ValueError(f"attention='packed' needs an attention implementation that honours a 4-D mask "
                         f"({' or '.join(MASKED_ATTENTION)}); this model uses {implementation!r}, which would "
                         f"ignore it (every token would see the other samples): use attention='per_sample'")
    if attention == "packed" and images_in_responses(model, batch):
        raise ValueError("attention='packed' lays out each group's pictures once, before its responses, and these "
                         "responses hold pictures of their own (an episode's tools returned them): use "
                         "attention='per_sample' or 'auto'")
    if attention == "per_sample" or (attention == "auto" and not _maskable(model, batch)):
        return _per_sample_outputs(model, batch, head, router)
    packing = _pack_groups(batch)
    if attention == "auto" and not _pays(model, batch, packing):
        return _per_sample_outputs(model, batch, head, router)
    return _packed_outputs(model, batch, packing, head, router)


def packing_pays(model, batch: Batch) -> bool:
    """Whether `attention="auto"` packs `batch`: the model's attention honours the mask (`_maskable`) and the packed
    layout pays (`_pays`)."""
    return _maskable(model, batch) and _pays(model, batch, _pack_groups(batch))


def _maskable(model, batch: Batch) -> bool:
    """Whether the packed layout can hold `batch`: the model's attention honours its mask, and no response holds
    pictures."""
    return model.config._attn_implementation in MASKED_ATTENTION and not images_in_responses(model, batch)


def _pays(model, batch: Batch, packing: Packing) -> bool:
    """Whether the packed layout `packing` of `batch` takes at most `PACKED_MASK_BYTES` for its mask and costs no
    more than the per-sample one, with a cost of tokens + query-key pairs / (`PAIRS_PER_TOKEN` x hidden size) (see
    there). Packed: its R x W slots, R·W² pairs; per-sample: B rows of the longest row's length L, B·L² pairs.
    Packing wins where a long prompt, or a long response prefix, is shared by a group's samples, and loses as the
    group's distinct response tokens grow (W grows with them)."""
    R, W = packing.span_R_W.shape
    if 4 * R * W * W > PACKED_MASK_BYTES:
        return False
    L = int((batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).max())
    pairs_per_token = PAIRS_PER_TOKEN * model.config.get_text_config().hidden_size
    return R * W * (1 + W / pairs_per_token) <= len(batch) * L * (1 + L / pairs_per_token)


def packed_mask_bytes(batch: Batch) -> int:
    """How many bytes the packed layout's fp32 mask R x W x W takes (`_pack_groups`)."""
    R, W = _pack_groups(batch).span_R_W.shape
    return 4 * R * W * W


def _packed_outputs(model, batch: Batch, packing: Packing, head=None, router: RouterStats | None = None) -> torch.Tensor:
    """`response_outputs` in the shared-prefix layout.

    No compute goes to padding, nor to any context more than once. Consecutive rows with the same prompt
    (a group of samples) share the prompt, and samples that begin with the same tokens share those tokens:
    a group is laid out as its prompt's real tokens once, then the tree of its distinct response prefixes
    (one slot per prefix, in depth-first order). Groups are packed back to back into rows of about
    `PACK_WIDTH` tokens (see there). A token attends to its prompt causally and to the prefix it ends, so
    every response token sees exactly the context it had unpacked (the same math; a shared token's
    gradient is the sum over the samples that share it); position ids are those each token had in the
    sampler. With images (a vision-language model's `image_inputs`), each group's pictures go through the vision
    tower once, and positions are 3-D (`_packed_image_inputs`).

    Whatever the attention implementation, the R x W x W additive mask is materialised in fp32 (4·R·W² bytes,
    `packed_mask_bytes`: over 1 GiB for 8 samples of 2048 tokens); "eager" attention also keeps R x heads x W x W
    scores and probabilities per layer for the backward.
    """
    R, W = packing.span_R_W.shape
    # in depth-first order a slot's descendants (and, for a prompt token, the rest of its group) directly
    # follow it: slot j is visible from the span_j slots that start at j
    column_W = torch.arange(W, device=packing.ids_N.device)
    allowed_R_W_W = (column_W[None, None, :] <= column_W[None, :, None]) & (
        column_W[None, :, None] < (column_W + packing.span_R_W)[:, None, :])
    bias_R_1_W_W = torch.zeros((R, 1, W, W), device=packing.ids_N.device).masked_fill_(
        ~allowed_R_W_W[:, None], torch.finfo(torch.float32).min)
    inputs = dict(input_ids=packing.ids_N.view(R, W), position_ids=packing.position_N.view(R, W),
                  attention_mask=bias_R_1_W_W)
    if has_images(batch):
        inputs |= _packed_image_inputs(model, batch, packing)
    return _outputs_at(model, packing.predictor_B_T, head, router, **inputs)


def _packed_image_inputs(model, batch: Batch, packing: Packing) -> dict[str, torch.Tensor]:
    """A vision-language model's forward inputs in the packed layout: each group's images once, in the order their
    image tokens come in the packed rows, and 3-D rotary positions (M-RoPE): a prompt token's as in its unpacked
    prompt, a response token's the text position after the prompt's last, one more per token (as in the sampler)."""
    R, W = packing.span_R_W.shape
    first_G = packing.first_G
    ids_G_P, mask_G_P = batch["prompt_ids"][first_G], batch["prompt_mask"][first_G]
    images_G = [batch["image_inputs"][b] for b in first_G.tolist()]
    prompt_3_G_P = forward_inputs(model, ids_G_P, mask_G_P, images_G)["position_ids"]
    # the prompt's j-th real token sits in column real_G_P[g, j] of its (padded) prompt row
    real_G_P = torch.sort((~mask_G_P.bool()).to(torch.uint8), dim=1, stable=True).indices
    group_N = packing.group_N.clamp(min=0)
    column_N = real_G_P[group_N, packing.position_N.clamp(max=real_G_P.shape[1] - 1)]
    G = torch.arange(len(first_G), device=ids_G_P.device)
    last_G = prompt_3_G_P[0, G, real_G_P[G, packing.prompt_len_G - 1]]  # text: its three positions are equal
    response_N = packing.position_N + (last_G - (packing.prompt_len_G - 1))[group_N]
    position_3_N = torch.where(packing.prompt_N, prompt_3_G_P[:, group_N, column_N], response_N)
    position_3_N = position_3_N.masked_fill(packing.group_N < 0, 0)
    in_slot_order = torch.argsort(packing.offset_G).tolist()
    ids_R_W = packing.ids_N.view(R, W)
    return image_inputs(model, ids_R_W, [images_G[g] for g in in_slot_order]) | {
        "position_ids": position_3_N.view(3, R, W)}


def _per_sample_outputs(model, batch: Batch, head=None, router: RouterStats | None = None) -> torch.Tensor:
    """`response_outputs` with each row on its own: its prompt's real tokens then its response, moved to the
    row's start (right padding, token 0), through plain causal attention. Nothing after a real token changes
    what it sees, so no mask is needed and none is built: with "sdpa" or flash attention, memory grows
    linearly in the longest row's length L (the eager implementation builds its own L x L causal mask).
    Position ids are 0, 1, ... as in the sampler; with images (`image_inputs`), a vision-language model's pixels and 3-D
    positions (`rl.models.vision.forward_inputs`)."""
    _check_response_mask(batch)
    ids_B_S = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    real_B_S = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).bool()
    # real tokens first, in their order (a stable sort of "is padding")
    order_B_S = torch.sort((~real_B_S).to(torch.uint8), dim=1, stable=True).indices
    L = max(int(real_B_S.sum(-1).max()), 1)
    ids_B_L = (ids_B_S.gather(1, order_B_S[:, :L]) * real_B_S.gather(1, order_B_S[:, :L])).long()
    # response token t is predicted by the row's position prompt_len + t - 1 (past the row's end: any)
    T = batch["response_ids"].shape[1]
    prompt_len_B = batch["prompt_mask"].sum(-1)
    predictor_B_T = (prompt_len_B[:, None] - 1 + torch.arange(T, device=ids_B_L.device)).clamp(0, L - 1)
    row_B_1 = torch.arange(len(ids_B_L), device=ids_B_L.device)[:, None]
    images = forward_inputs(model, ids_B_L, real_B_S.gather(1, order_B_S[:, :L]).long(), batch["image_inputs"]) \
        if has_images(batch) else {}
    return _outputs_at(model, row_B_1 * L + predictor_B_T, head, router, input_ids=ids_B_L, **images)


def images_in_responses(model, batch: Batch) -> bool:
    """Whether some row's response holds image tokens (an episode whose tools returned pictures: they stand in its
    context, never sampled): such rows take the per-sample layout."""
    never = never_sampled(model)
    if not never or not has_images(batch):
        return False
    ids = batch["response_ids"][batch["response_mask"].bool()]
    return bool(torch.isin(ids, torch.tensor(never, device=ids.device)).any())


def has_images(batch: Batch) -> bool:
    """Whether some row of `batch` has images (its `image_inputs` column: per row, the prompt's pixels and grids)."""
    return "image_inputs" in batch and any(batch["image_inputs"])


def _outputs_at(model, predictor_B_T: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None,
                router: RouterStats | None, **inputs) -> torch.Tensor:
    """The model's outputs `[B, T, F]` (fp32) at the flat positions `predictor_B_T` of its input `[R, W]`; with
    `head`, what `head` makes of the hidden states there `[B·T, H]`, computed in place of the model's output
    embedding (inside its forward, where sharded weights are gathered). `router` learns those positions."""
    if router is not None:
        router.at = predictor_B_T
    if head is None:
        out_R_W_F = model(**inputs, use_cache=False).logits
        never = never_sampled(model)
        out_B_T_F = out_R_W_F.flatten(0, 1)[predictor_B_T].float()
        return out_B_T_F.index_fill(-1, torch.tensor(never, device=out_B_T_F.device), NEVER_LOGIT) \
            if never else out_B_T_F
    output_embedding = model.get_output_embeddings()
    output_embedding.forward = lambda hidden_R_W_H: head(hidden_R_W_H.flatten(0, 1)[predictor_B_T.reshape(-1)])
    try:
        return model(**inputs, use_cache=False).logits.view(*predictor_B_T.shape, -1)
    finally:
        del output_embedding.forward  # its class's forward again


def response_stats(model, batch: Batch, *, temperature: float, chunk_tokens: int, attention: str = "auto",
                   sum_pi2: bool = False, router: RouterStats | None = None) -> torch.Tensor:
    """Per response token `[B, T, 2]` (`[B, T, 3]` with `sum_pi2`): its log-prob, the entropy of its distribution
    (and `Σ_v π_v²`), from logits scaled by 1/temperature, without ever holding the `[B, T, V]` logits: the model's
    output head runs on `chunk_tokens` positions at a time, and under autograd each chunk is checkpointed, so the
    backward recomputes that chunk's logits instead of keeping them. Memory of one chunk's logits rather than a
    micro-batch's (4096 tokens of a 151k vocabulary: 2.5 GB in fp32; 32k tokens' logits, softmax and gradient take
    over 60 GB), for one more head matmul in the backward. The numbers of `token_logp` and `entropy_from_logits` on
    `response_logits`, up to float rounding."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"logit_chunk_tokens: {type(model).__name__} caps its logits after the output head "
                         f"(final_logit_softcapping), which a chunked head would skip; set logit_chunk_tokens=0")
    ids_N = batch["response_ids"].reshape(-1)

    def head(hidden_N_H: torch.Tensor) -> torch.Tensor:
        output_embedding = model.get_output_embeddings()  # read here: inside the forward its weights are whole
        bias_V = _never_drawn(model, output_embedding.bias, output_embedding.weight)
        chunks = []
        for start in range(0, len(ids_N), chunk_tokens):
            args = (hidden_N_H[start : start + chunk_tokens], output_embedding.weight, bias_V,
                    ids_N[start : start + chunk_tokens], temperature, sum_pi2)
            chunks.append(checkpoint(_head_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                          else _head_stats(*args))
        return torch.cat(chunks)
    return response_outputs(model, batch, attention, head=head, router=router)


def drawn_logp(model, logp_B_T: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    """`logp_B_T` with 0 at tokens the policy never draws (`rl.models.vision.never_sampled`: in a response, the
    image tokens of a tool's picture, never sampled and never trained), as the sampler's log-prob is 0 at every token
    it did not draw. Their log-prob is about `NEVER_LOGIT`, and the exp of a difference with it would be inf (inf x
    a loss mask's 0 is NaN)."""
    never = never_sampled(model)
    if not never:
        return logp_B_T
    return logp_B_T.masked_fill(torch.isin(ids_B_T, torch.tensor(never, device=ids_B_T.device)), 0.0)


def _never_drawn(model, bias_V: torch.Tensor | None, weight_V_H: torch.Tensor) -> torch.Tensor | None:
    """The output head's bias, `NEVER_LOGIT` at the tokens the policy never draws (`rl.models.vision.never_sampled`):
    probability 0, and no inf to make an entropy's 0·z a NaN."""
    never = never_sampled(model)
    if not never:
        return bias_V
    bias_V = torch.zeros(weight_V_H.shape[0], dtype=weight_V_H.dtype, device=weight_V_H.device) if bias_V is None \
        else bias_V
    return bias_V.index_fill(0, torch.tensor(never, device=bias_V.device), NEVER_LOGIT)


def _head_stats(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, bias_V: torch.Tensor | None, ids_N: torch.Tensor,
                temperature: float, sum_pi2: bool) -> torch.Tensor:
    """`[N, 2]` (`[N, 3]`): log-prob of `ids_N`, entropy (and `Σ_v π_v²`) from these positions' logits."""
    logits_N_V = F.linear(hidden_N_H, weight_V_H, bias_V).float()
    if temperature not in (0, 1):
        logits_N_V = logits_N_V / temperature
    if sum_pi2:
        logp_N, pi2_N = token_logp_and_sum_pi2(logits_N_V, ids_N)
        return torch.stack([logp_N, entropy_from_logits(logits_N_V), pi2_N], -1)
    return torch.stack([token_logp(logits_N_V, ids_N), entropy_from_logits(logits_N_V)], -1)


def _check_response_mask(batch: Batch) -> None:
    """A response is its first tokens: a response_mask with a 0 before a 1 is a ValueError."""
    response_mask_B_T = batch["response_mask"].bool()
    gap_B = (response_mask_B_T[:, 1:] & ~response_mask_B_T[:, :-1]).any(-1)
    if gap_B.any():
        raise ValueError(f"response_mask of row {int(gap_B.nonzero()[0])} has a 0 before a 1: a response is "
                         f"its first tokens (mask out tokens from the loss with loss_mask)")


def _new_groups(batch: Batch) -> torch.Tensor:
    """`[B]`: whether row b starts a group (its prompt differs from the previous row's: its tokens, or its images:
    the same question about another picture is another prompt)."""
    prompt_ids_B_P, prompt_mask_B_P = batch["prompt_ids"], batch["prompt_mask"].bool()
    new_group_B = torch.ones(len(prompt_ids_B_P), dtype=torch.bool, device=prompt_ids_B_P.device)
    new_group_B[1:] = ((prompt_ids_B_P[1:] != prompt_ids_B_P[:-1]) | (prompt_mask_B_P[1:] != prompt_mask_B_P[:-1])).any(-1)
    if has_images(batch):
        images = batch["image_inputs"]
        for b in (~new_group_B).nonzero().squeeze(-1).tolist():
            new_group_B[b] = not same_images(images[b], images[b - 1])
    return new_group_B


@dataclass
class Packing:
    """The shared-prefix layout of `response_outputs` (`_pack_groups`) over N = R·W slots. Padding slots hold token
    0 and attend only to themselves."""
    ids_N: torch.Tensor
    position_N: torch.Tensor
    """Each slot's position as in the sampler (0, 1, ... from its prompt's first real token)."""
    span_R_W: torch.Tensor
    """How many slots from each one on may attend to it."""
    predictor_B_T: torch.Tensor
    """The slot whose output predicts each response token."""
    group_N: torch.Tensor
    """The group each slot holds (-1: padding) ..."""
    prompt_N: torch.Tensor
    """... and whether it is one of the group's prompt tokens."""
    first_G: torch.Tensor
    """Each group's first row."""
    prompt_len_G: torch.Tensor
    offset_G: torch.Tensor
    """Each group's first slot."""


def _pack_groups(batch: Batch) -> Packing:
    """The shared-prefix layout of `response_outputs` (see `Packing`)."""
    prompt_ids_B_P, prompt_mask_B_P = batch["prompt_ids"], batch["prompt_mask"].bool()
    response_ids_B_T, response_mask_B_T = batch["response_ids"], batch["response_mask"].bool()
    T, device = response_ids_B_T.shape[1], response_ids_B_T.device
    _check_response_mask(batch)
    new_group_B = _new_groups(batch)
    group_B = new_group_B.cumsum(0) - 1
    first_G = new_group_B.nonzero().squeeze(-1)  # each group's first row
    G = len(first_G)
    prompt_len_G = prompt_mask_B_P[first_G].sum(-1)
    tree = _prefix_tree(group_B, response_ids_B_T, response_mask_B_T, G)
    group_len_G = prompt_len_G + tree.nodes_G
    offsets, rows, W = _pack(group_len_G.tolist())
    offset_G = torch.tensor(offsets, device=device)
    N = rows * W
    ids_N, position_N = (torch.zeros(N, dtype=torch.long, device=device) for _ in range(2))
    span_N = torch.ones(N, dtype=torch.long, device=device)
    group_N = torch.full((N,), -1, dtype=torch.long, device=device)
    prompt_N = torch.zeros(N, dtype=torch.bool, device=device)
    # each group's prompt, once; a prompt token is visible from the rest of its group
    prompt_mask_G_P = prompt_mask_B_P[first_G]
    position_G_P = prompt_mask_G_P.cumsum(-1) - 1
    slot_G_P = offset_G[:, None] + position_G_P
    slots = slot_G_P[prompt_mask_G_P]
    ids_N[slots] = prompt_ids_B_P[first_G][prompt_mask_G_P]
    position_N[slots] = position_G_P[prompt_mask_G_P]
    span_N[slots] = ((offset_G + group_len_G)[:, None] - slot_G_P)[prompt_mask_G_P]
    group_N[slots] = torch.arange(G, device=device)[:, None].expand_as(slot_G_P)[prompt_mask_G_P]
    prompt_N[slots] = True
    # then its response prefixes in depth-first order; a prefix is visible from its subtree
    slot_M = offset_G[tree.group_M] + prompt_len_G[tree.group_M] + tree.preorder_M
    ids_N[slot_M], span_N[slot_M], group_N[slot_M] = tree.token_M, tree.size_M, tree.group_M
    position_N[slot_M] = prompt_len_G[tree.group_M] + tree.depth_M
    # response token 0 is predicted by the group's last prompt token, token t by the prefix of its first t
    predictor_B_T = (offset_G + prompt_len_G - 1)[group_B][:, None].repeat(1, T)  # past a row's end: any slot
    after_B_T = tree.node_B_T[:, :-1] >= 0
    predictor_B_T[:, 1:][after_B_T] = slot_M[tree.node_B_T[:, :-1][after_B_T]]
    return Packing(ids_N=ids_N, position_N=position_N, span_R_W=span_N.view(-1, W), predictor_B_T=predictor_B_T,
                   group_N=group_N, prompt_N=prompt_N, first_G=first_G, prompt_len_G=prompt_len_G, offset_G=offset_G)


def _pack(lengths: list[int]) -> tuple[list[int], int, int]:
    """Where each group starts (row · W + column), the number of rows and their width W: groups longest
    first, each into the first row with room (never split). W is the multiple of the longest group, up to
    2 · PACK_WIDTH, that leaves the fewest slots (the narrower on a tie: attention grows with W²)."""
    longest = max(lengths)
    best = None
    for W in range(longest, max(longest, 2 * PACK_WIDTH) + 1, longest):
        used, offsets = [], [0] * len(lengths)
        for g in sorted(range(len(lengths)), key=lambda g: -lengths[g]):
            row = next((r for r, u in enumerate(used) if u + lengths[g] <= W), len(used))
            if row == len(used):
                used.append(0)
            offsets[g], used[row] = row * W + used[row], used[row] + lengths[g]
        if best is None or len(used) * W < best[1] * best[2]:
            best = (offsets, len(used), W)
    return best


@dataclass
class PrefixTree:
    """The distinct response prefixes of each group of a batch: node M is one prefix, ending in `token_M`."""
    node_B_T: torch.Tensor
    """The node of row b's first t+1 response tokens (-1 past the row's end)."""
    token_M: torch.Tensor
    depth_M: torch.Tensor
    """Its length - 1."""
    group_M: torch.Tensor
    size_M: torch.Tensor
    """Nodes in its subtree, itself included."""
    preorder_M: torch.Tensor
    """Its position in a depth-first walk of its group's tree (children in token order)."""
    nodes_G: torch.Tensor
    """Nodes per group."""


def _prefix_tree(group_B: torch.Tensor, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor, groups: int) -> PrefixTree:
    """The prefix tree of each group's responses (a group's rows are consecutive; masks are left-aligned), from the
    rows in lexicographic order: there a depth-first walk of a group's tree (children in token order) is its rows in
    turn, each adding the tokens after its longest common prefix with the row before (`lcp_I`), and a node's subtree
    is every node up to the first later row that shares less than the node's prefix. All ops are over `[B, T]`."""
    B, T = ids_B_T.shape
    device = ids_B_T.device
    t_T = torch.arange(T, device=device)
    code_B_T = torch.where(mask_B_T, ids_B_T + 1, 0)  # padding before every token: a prefix before its extensions
    order_I = torch.argsort(_row_ranks(torch.cat([group_B[:, None], code_B_T], 1)), stable=True)
    code_I_T, group_I, len_I = code_B_T[order_I], group_B[order_I], mask_B_T.sum(-1)[order_I]
    lcp_I = torch.zeros(B, dtype=torch.long, device=device)
    if B > 1:
        same_I_T = (code_I_T[1:] == code_I_T[:-1]) & (code_I_T[1:] > 0)
        lcp_I[1:] = same_I_T.cumprod(-1).sum(-1) * (group_I[1:] == group_I[:-1])
    new_I = len_I - lcp_I
    start_I = new_I.cumsum(0) - new_I  # the first node a row adds, numbered in depth-first order over all groups
    M = int(new_I.sum())
    nodes_G = torch.zeros(groups, dtype=torch.long, device=device).index_add_(0, group_I, new_I)
    # the node at (row i, depth t) was added by the last row j <= i with lcp_j <= t ...
    opens_I_T = lcp_I[:, None] <= t_T
    row_I_1 = torch.arange(B, device=device)[:, None]
    owner_I_T = torch.where(opens_I_T, row_I_1, -1).cummax(0).values
    node_I_T = start_I[owner_I_T] + t_T - lcp_I[owner_I_T]
    node_I_T = node_I_T.masked_fill(t_T >= len_I[:, None], -1)
    # ... and its subtree ends where the first later row j with lcp_j <= t adds its first node (or at the end)
    after_I_T = torch.where(opens_I_T, row_I_1, B).flip(0).cummin(0).values.flip(0)
    after_I_T = torch.cat([after_I_T[1:], torch.full((1, T), B, device=device)])
    end_I_T = torch.cat([start_I, torch.tensor([M], device=device)])[after_I_T]
    added_I_T = opens_I_T & (t_T < len_I[:, None])
    node_B_T = torch.empty_like(node_I_T)
    node_B_T[order_I] = node_I_T
    group_M = group_I[:, None].expand(B, T)[added_I_T]
    return PrefixTree(node_B_T=node_B_T, token_M=ids_B_T[order_I][added_I_T],
                      depth_M=t_T.expand(B, T)[added_I_T], group_M=group_M,
                      size_M=(end_I_T - node_I_T)[added_I_T],
                      preorder_M=torch.arange(M, device=device) - (nodes_G.cumsum(0) - nodes_G)[group_M],
                      nodes_G=nodes_G)


def _row_ranks(keys_B_K: torch.Tensor) -> torch.Tensor:
    """`[B]`: each row's rank in the lexicographic order of the rows of `keys_B_K` (integers >= 0; equal rows, equal
    ranks), by prefix doubling: pairs of adjacent columns are replaced by their rank among all such pairs, halving
    the columns until one is left (log2 K sorts of at most B·K/2 pairs)."""
    rank_B_K = keys_B_K
    while rank_B_K.shape[1] > 1:
        if rank_B_K.shape[1] % 2:
            rank_B_K = F.pad(rank_B_K, (0, 1))
        pair_B_K = rank_B_K[:, 0::2] * (int(rank_B_K.max()) + 1) + rank_B_K[:, 1::2]
        rank_B_K = torch.unique(pair_B_K, return_inverse=True)[1]
    return rank_B_K[:, 0]


def response_logits(model, batch: Batch, temperature: float = 1.0, attention: str = "auto",
                    router: RouterStats | None = None) -> torch.Tensor:
    """Logits `[B, T, V]` of each response token, scaled by 1/temperature (temperature 0, greedy: unscaled)."""
    logits_B_T_V = response_outputs(model, batch, attention, router=router)
    return logits_B_T_V / temperature if temperature not in (0, 1) else logits_B_T_V


def batch_logp(model, batch: Batch, *, temperature: float, micro_batch_tokens: int, world_size: int = 1,
               device: str | torch.device = "cpu", attention: str = "auto", sum_pi2: bool = False, topk: int = 0,
               vocab: int | None = None, chunk_tokens: int = 0) -> torch.Tensor:
    """Log-probs of every response token of `batch`, `[B, T]` on CPU (0 on padding), in micro-batches; with
    `sum_pi2`, `[B, T, 2]`: the log-probs and `Σ_v π_v²` of each token from the same forward (what OTB reads);
    with `topk` = k, `[B, T, 1 + 2k]`: the log-probs, then the model's k most likely tokens' log-probs and their ids
    (as floats, exact below 2^24) among the first `vocab` ids (a distillation teacher's, `teacher_topk`).
    `chunk_tokens` > 0: the output head `chunk_tokens` positions at a time (`response_stats`; not with `topk`)."""
    def logp(micro: Batch) -> torch.Tensor:
        if chunk_tokens and not topk:
            stats_B_T_S = response_stats(model, micro, temperature=temperature, chunk_tokens=chunk_tokens,
                                         attention=attention, sum_pi2=sum_pi2)
            logp_B_T = drawn_logp(model, stats_B_T_S[..., 0], micro["response_ids"])
            return torch.stack([logp_B_T, stats_B_T_S[..., 2]], -1) if sum_pi2 else logp_B_T
        logits_B_T_V = response_logits(model, micro, temperature, attention)
        if sum_pi2:
            logp_B_T, pi2_B_T = token_logp_and_sum_pi2(logits_B_T_V, micro["response_ids"])
            return torch.stack([drawn_logp(model, logp_B_T, micro["response_ids"]), pi2_B_T], -1)
        logp_B_T = drawn_logp(model, token_logp(logits_B_T_V, micro["response_ids"]), micro["response_ids"])
        if topk:
            topk_logp_B_T_K, ids_B_T_K = teacher_topk(logits_B_T_V, topk, vocab)
            return torch.cat([logp_B_T[..., None], topk_logp_B_T_K, ids_B_T_K.float()], -1)
        return logp_B_T
    return batch_outputs(logp, batch, micro_batch_tokens=micro_batch_tokens, world_size=world_size, device=device,
                         packs=packs(model, attention))


@torch.no_grad()
def batch_outputs(fn: Callable[[Batch], torch.Tensor], batch: Batch, *, micro_batch_tokens: int, world_size: int = 1,
                  device: str | torch.device = "cpu", packs: Callable[[Batch], bool] | None = None) -> torch.Tensor:
    """`fn(micro)` (`[b, t]` per response token, or `[b, t, k]`) over the batch's micro-batches, assembled into
    `[B, T]` (`[B, T, k]`) on CPU in fp32, 0 on padding: the one no-grad pass the policy's log-probs and the
    critic's values share."""
    out_B_T, start = None, 0
    for micro in rank_micro_batches(batch, micro_batch_tokens, world_size, packs):
        micro = micro.trimmed().to(device)
        part_b_t = fn(micro)
        if out_B_T is None:
            out_B_T = torch.zeros((*batch["response_ids"].shape, *part_b_t.shape[2:]), dtype=torch.float32)
        out_B_T[start : start + len(micro), : part_b_t.shape[1]] = part_b_t.float().cpu()
        start += len(micro)
    if out_B_T is None:  # no rows
        return torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
    mask_B_T = batch["response_mask"]
    return out_B_T * mask_B_T.reshape(*mask_B_T.shape, *[1] * (out_B_T.dim() - 2))


def micro_batches(batch: Batch, micro_batch_tokens: int, packs: Callable[[Batch], bool] | None = None) -> list[Batch]:
    """Consecutive rows whose forward holds at most `micro_batch_tokens` tokens: rows x padded length; or, where
    `packs(rows)` says they are laid out packed (`packing_pays`), each group's prompt once plus its rows' response
    tokens (what the packed layout holds at most: shared response prefixes take fewer). Rows cut by that count whose
    packed layout would not pay are cut again by the padded count.

    A single row longer than the budget gets a micro-batch of its own.
    """
    if packs is None:
        return _cut(batch, micro_batch_tokens, packed=False)
    chunks = []
    for chunk in _cut(batch, micro_batch_tokens, packed=True):
        chunks += [chunk] if len(chunk) == 1 or packs(chunk) else _cut(chunk, micro_batch_tokens, packed=False)
    return chunks


def _cut(batch: Batch, budget: int, packed: bool) -> list[Batch]:
    """`micro_batches` by one count: padded (rows x the longest prompt plus the longest response) or packed (each
    group's prompt once, every response token)."""
    prompt_len = batch["prompt_mask"].sum(-1).tolist()
    response_len = batch["response_mask"].sum(-1).tolist()
    new_group = _new_groups(batch).tolist() if packed and len(batch) else []
    chunks, start, widest_p, widest_r, slots = [], 0, 0, 0, 0
    for i, (p, r) in enumerate(zip(prompt_len, response_len)):
        wp, wr = max(widest_p, p), max(widest_r, r)
        grown = slots + r + (p if i == start or new_group[i] else 0) if packed else (i - start + 1) * (wp + wr)
        if i > start and grown > budget:
            chunks.append(batch[start:i])
            start, wp, wr, grown = i, p, r, p + r
        widest_p, widest_r, slots = wp, wr, grown
    if len(batch):
        chunks.append(batch[start:])
    return chunks


def packs(model, attention: str) -> Callable[[Batch], bool] | None:
    """Whether `response_outputs` lays a micro-batch out packed under `attention` (`micro_batches`' `packs`), or None
    when it never does."""
    if attention == "per_sample":
        return None
    return lambda micro: attention == "packed" or packing_pays(model, micro)


def rank_micro_batches(batch: Batch, micro_batch_tokens: int, world_size: int = 1,
                       packs: Callable[[Batch], bool] | None = None) -> list[Batch]:
    """`micro_batches`, with the same count on every rank of the process group.

    FSDP2 gathers parameters collectively at every forward, so all ranks must run the same number of
    forwards: a rank that needs fewer micro-batches than the busiest one splits its rows more finely.
    """
    chunks = micro_batches(batch, micro_batch_tokens, packs)
    if world_size == 1:
        return chunks
    count = torch.tensor([len(chunks)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return chunks if len(chunks) == int(count) else batch.chunk(int(count))
