"""A batched decode loop over a transformers causal LM with a KV cache, sharing what the rows share.

Prefill each prompt once, then one forward per new token over the last token only. The decoder's batch
holds one row per distinct context, not per sample: the n samples of a prompt share its prompt, and
samples that drew the same tokens so far share their next-token logits (each still draws with its own
random number), so a confident policy decodes few rows. A row that draws a stop token leaves; the rest
are padding (masked out).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from rlbench import models
from rlbench.algorithms import token_logp
from rlbench.batch import Batch, left_pad
from rlbench.models.lora import LoRA, delta, module_pairs
from rlbench.models.vision import NEVER_LOGIT, forward_inputs, has_vision_tower, never_sampled
from rlbench.samplers import decoder
from rlbench.samplers.decoder import CompactDecoder
from rlbench.samplers.base import SamplingParams, as_tensors
from rlbench.samplers.kv_store import KVStore


class HFSampler:
    """The Sampler protocol on a transformers model (any device the model is on).

    Llama-family models (Qwen2, Qwen3, Llama) decode through `CompactDecoder`; any other causal LM
    through transformers' own forward with a DynamicCache. Both give the model's exact distribution. With
    `SamplingParams.keep_cache`, the compact decoder keeps the K/V of finished contexts for the next call
    (`kv_store`); the other path ignores it.
    """

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), lora: LoRA | None = None):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.stop_token_ids = torch.tensor(sorted({eos_token_id, *stop_token_ids}), dtype=torch.long)
        self.decoder = CompactDecoder(model) if decoder.supports(model) else TransformersDecoder(model)
        self.lora = lora
        self.adapter: dict[str, torch.Tensor] = {}
        """Under LoRA, the adapter it samples with (by the policy's names; empty: the base model, as B = 0 starts)."""
        self.never = torch.tensor(never_sampled(model), dtype=torch.long, device=model.device)
        """Tokens it never draws (a vision-language model's image markup: `rl.models.vision.never_sampled`)."""
        self.kept = KVStore()
        """K/V of the contexts that ended with a stop token in calls with `keep_cache` (compact decoder only)."""

    @classmethod
    def from_pretrained(cls, model_dir: str, device: str = "cpu", precision: str = "fp32",
                        lora: LoRA | None = None) -> HFSampler:
        """A sampler over its own copy of a local model directory's weights, on `device`, in fp32 or (for
        precision "bf16") bfloat16; `load_weights` casts what it loads to that type. With `lora`, the weights
        it loads are that adapter's (see `load_weights`)."""
        model, tokenizer = models.load(model_dir, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        return cls(model.to(device), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   lora=lora)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 interrupt: threading.Event | None = None, images: Sequence[dict] | None = None) -> Batch:
        """The Sampler protocol's `generate`; `interrupt` (set from another thread) stops every row after the token
        it is drawing (at least one): a partial rollout then continues them with new weights (`PartialRollouts`).
        `images`: per prompt, its pixels and grids (`rl.models.vision.Vision.encode`'s dict, empty for none), for a
        vision-language model whose prompt ids hold the image tokens."""
        if images is not None and any(images) and not has_vision_tower(self.model):
            raise ValueError(f"images given to a text-only model ({type(self.model).__name__}): it has no vision tower")
        stop_ids = torch.tensor(sorted({*self.stop_token_ids.tolist(), *params.stop_token_ids}), device=self.model.device)
        # inference mode costs a tenth less per op than no_grad; its tensors are cloned into ordinary ones
        with torch.inference_mode():
            tokens_B_T, logp_B_T = self._decode(prompt_ids, params, stop_ids, interrupt, images)
        self.kept.end_call()
        return self._responses(tokens_B_T.clone(), logp_B_T.clone(), stop_ids)

    def _decode(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, stop_ids: torch.Tensor,
                interrupt: threading.Event | None = None,
                images: Sequence[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What each row drew and its log-prob, `[B, steps]` (after a row's stop token: more draws, or pad)."""
        device = self.model.device
        keep = params.keep_cache and isinstance(self.decoder, CompactDecoder)
        B, T = len(prompt_ids) * params.n, params.max_new_tokens
        # a uniform number per row and position: what a row draws does not depend on the decoder's batch
        if params.seeds is None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
            uniform_B_T = torch.rand(B, T, generator=generator, device=device)
        else:  # each prompt's rows from its own seed
            uniform_B_T = torch.cat([torch.rand(params.n, T, device=device, generator=torch.Generator(
                device=device).manual_seed(seed)) for seed in params.seeds]) if B else torch.empty(0, T, device=device)
        tokens_B_T = torch.full((B, T), self.pad_token_id, dtype=torch.long, device=device)
        logp_B_T = torch.zeros((B, T), device=device)
        prompts = [[int(i) for i in ids] for ids in prompt_ids]
        # the same prompt given twice (an agentic step's first turns: an episode each) is prefilled once, one decoder
        # row shared by its rows until they draw different tokens; prompts with pictures are kept apart
        distinct, decoder_row_P = _distinct(prompts) if images is None or not any(images) else (
            list(range(len(prompts))), list(range(len(prompts))))
        rows_b = torch.arange(B, device=device)  # the rows still drawing ...
        context_b = torch.tensor(decoder_row_P, device=device)[rows_b // params.n]  # ... their context's decoder row
        logits_c_V = self._start([prompts[p] for p in distinct], T, [prompts[p] for p in distinct] if keep else None,
                                 images and [images[p] for p in distinct])
        stopped = []  # (row, step, K/V) of each decoder row whose context ended with a stop token
        V = logits_c_V.shape[-1]
        for t in range(T):
            logits_b_V = logits_c_V[context_b].float()
            if len(self.never):
                logits_b_V.index_fill_(-1, self.never, NEVER_LOGIT)
            token_b, token_logp_b = sample_next(logits_b_V, params, uniform_B_T[rows_b, t])
            tokens_B_T[rows_b, t], logp_B_T[rows_b, t] = token_b, token_logp_b
            running_b = ~torch.isin(token_b, stop_ids)
            if keep:
                stopped += self._stopped_contexts(rows_b[~running_b], context_b[~running_b], t)
            if t == T - 1 or not bool(running_b.any()) or (interrupt is not None and interrupt.is_set()):
                break
            rows_b, context_b, token_b = rows_b[running_b], context_b[running_b], token_b[running_b]
            # the next contexts: one decoder row per distinct (context, token); a context that drew k distinct
            # tokens is copied k times, one that only drew stop tokens is dropped
            next_c, context_b = torch.unique(context_b * V + token_b, return_inverse=True)
            self.decoder.keep(next_c // V)
            logits_c_V = self.decoder.step(next_c % V)
        if stopped:  # keyed by the prompt and what the row drew before its stop token
            generated = tokens_B_T[[row for row, _, _ in stopped]].tolist()
            for (row, step, kv), tokens in zip(stopped, generated):
                self.kept.store(prompts[row // params.n] + tokens[:step], *kv)
        return tokens_B_T[:, : t + 1], logp_B_T[:, : t + 1]

    def _start(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
               prompts: list[list[int]] | None, images: Sequence[dict] | None = None) -> torch.Tensor:
        """Prefill the prompts; given their `prompts` (keep_cache), with the kept K/V of the contexts they continue;
        given their `images`, with the pixels (a vision-language model decodes through transformers' forward)."""
        ids_N_P, mask_N_P = (x.to(self.model.device) for x in left_pad(prompt_ids, self.pad_token_id))
        if images is not None and any(images):
            return self.decoder.start(ids_N_P, mask_N_P, max_new_tokens,
                                      inputs=forward_inputs(self.model, ids_N_P, mask_N_P, images))
        if prompts is None:
            return self.decoder.start(ids_N_P, mask_N_P, max_new_tokens)
        cached_N = self.kept.take(prompts, self.model.dtype, self.model.device)
        return self.decoder.start(ids_N_P, mask_N_P, max_new_tokens, cached_N)

    def _stopped_contexts(self, rows: torch.Tensor, contexts: torch.Tensor,
                          t: int) -> list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]]:
        """(a row, t, the K/V of its context) for each distinct decoder row among `contexts`, those of the
        `rows` that drew a stop token at step t."""
        if not len(rows):
            return []
        first_row = dict(zip(contexts.tolist()[::-1], rows.tolist()[::-1]))  # each context's first row
        return [(row, t, kv) for row, kv in zip(first_row.values(), self.decoder.contexts(list(first_row)))]

    def _responses(self, tokens_B_T: torch.Tensor, logp_B_T: torch.Tensor, stop_ids: torch.Tensor) -> Batch:
        """The Batch of what each row drew up to and including its first stop token (pad and 0 after it)."""
        stop_B_T = torch.isin(tokens_B_T, stop_ids)
        mask_B_T = (stop_B_T.cumsum(-1) - stop_B_T.long()) == 0  # no stop token before
        return Batch({
            "response_ids": tokens_B_T.where(mask_B_T, self.pad_token_id).cpu(),
            "response_mask": mask_B_T.long().cpu(),
            "sampler_logp": (logp_B_T * mask_B_T).cpu(),
            "finished": (stop_B_T & mask_B_T).any(-1).cpu(),
        })

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights it samples with (behind the policy's after `update(sync=False)`; checkpoints keep them):
        under LoRA, the adapter."""
        return dict(self.adapter) if self.lora is not None else self.model.state_dict()

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Copy a full state dict (tensors, or numpy arrays such as read-only views from Ray's object store),
        cast to the sampler's dtype, tensor by tensor into the model's own (`load_state_dict` walks the
        modules: a fifth of a tiny model's sync). Under LoRA, the adapter's tensors instead (the policy's
        `state_dict()`): the base weights stay, the decoder merges s · B A into its fused copies of them."""
        if self.lora is not None:
            return self._load_adapter(as_tensors(state_dict))
        state, own = as_tensors(state_dict), self.model.state_dict()  # own: views of the model's tensors
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        missing, unexpected = sorted(own.keys() - state.keys() - tied), sorted(state.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(f"weights do not fit the sampler's model: missing {missing}, unexpected {unexpected}")
        for name, tensor in state.items():  # all checked before any is copied
            if own[name].shape != tensor.shape:
                raise ValueError(f"weights do not fit the sampler's model: {name} has shape {tuple(tensor.shape)}, "
                                 f"not {tuple(own[name].shape)}")
        for name, tensor in state.items():
            own[name].copy_(tensor)
        self.decoder.refresh()
        self.kept.clear()  # K/V of the old weights

    def _load_adapter(self, adapter: dict[str, torch.Tensor]) -> None:
        """Take a LoRA adapter (ValueError naming what does not fit: a layer the decoder has no such weight for,
        a shape, a different set of tensors than the first load's)."""
        if self.adapter and adapter.keys() != self.adapter.keys():
            changed = sorted(adapter.keys() ^ self.adapter.keys())
            raise ValueError(f"adapter does not fit the sampler's: these tensors are in only one of them: {changed[:6]}")
        pairs, shapes = module_pairs(adapter), self.decoder.adaptable()
        for module, (A, B) in pairs.items():
            if module not in shapes:
                raise ValueError(f"the hf sampler cannot apply LoRA to {module!r}: it adapts "
                                 f"{self.decoder.adaptable_layers}")
            if (B.shape[0], A.shape[1]) != shapes[module] or A.shape[0] != B.shape[1]:
                raise ValueError(f"adapter does not fit the sampler's model: {module} changes a weight of shape "
                                 f"{(B.shape[0], A.shape[1])} (A {tuple(A.shape)}, B {tuple(B.shape)}), not "
                                 f"{tuple(shapes[module])}")
        self.adapter = {name: tensor.clone() for name, tensor in adapter.items()}  # the policy's may be live
        self.decoder.lora = self.lora
        self.decoder.adapter = {module: (A.to(self.model.device), B.to(self.model.device))
                                for module, (A, B) in module_pairs(self.adapter).items()}
        self.decoder.refresh()
        self.kept.clear()


class TransformersDecoder:
    """start / step over any transformers causal LM, with its DynamicCache (nothing kept across calls:
    `keep_cache` has no effect on this path)."""

    adaptable_layers = "the model's linear layers"

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.adapter: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora: LoRA | None = None
        """A LoRA adapter, `{module path: (A, B)}` and its `rl.LoRA` (`HFSampler.load_weights`), merged into the
        model's own weights by `refresh`: each adapted weight becomes W + s · B A, W kept in `base`."""
        self.base: dict[str, torch.Tensor] = {}

    def adaptable(self) -> dict[str, torch.Size]:
        """{module path: weight shape} of the linear layers an adapter may change (all of them)."""
        return {name: m.weight.shape for name, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}

    @torch.no_grad()
    def refresh(self) -> None:
        """Merge the adapter into the adapted layers' weights (from the weights as loaded, kept at the first merge);
        without one, nothing to do: the forward reads the model's parameters."""
        for module, (A, B) in self.adapter.items():
            weight = self.model.get_submodule(module).weight
            base = self.base.setdefault(module, weight.detach().clone())
            weight.copy_((base.float() + delta(A, B, self.lora)).to(weight.dtype))

    def start(self, ids_N_P: torch.Tensor, mask_N_P: torch.Tensor, max_new_tokens: int,
              inputs: dict | None = None) -> torch.Tensor:
        """Prefill the prompts (see `CompactDecoder.start`); `inputs`: more of the forward's keyword arguments, a
        vision-language model's pixels and 3-D positions (`rl.models.vision.forward_inputs`). A prompt's last token
        is text, so its three positions are equal and each new token's is one more (one position for all three)."""
        self.cache = DynamicCache()
        inputs = dict(inputs or {})
        position_N_P = inputs.pop("position_ids", None)
        if position_N_P is None:
            position_N_P = (mask_N_P.cumsum(-1) - 1).clamp(min=0)
        logits_N_V = self.model(input_ids=ids_N_P, attention_mask=mask_N_P, position_ids=position_N_P,
                                past_key_values=self.cache, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]
        self.attention_N_L, self.position_N = mask_N_P, position_N_P[..., -1].reshape(-1, len(ids_N_P))[0]
        return logits_N_V

    def keep(self, rows_c: torch.Tensor) -> None:
        """Go on with these rows of the batch (see `CompactDecoder.keep`)."""
        self.cache.batch_select_indices(rows_c)
        self.attention_N_L, self.position_N = self.attention_N_L[rows_c], self.position_N[rows_c]

    def step(self, token_N: torch.Tensor) -> torch.Tensor:
        self.attention_N_L = torch.cat([self.attention_N_L, self.attention_N_L.new_ones(len(token_N), 1)], dim=1)
        self.position_N = self.position_N + 1
        return self.model(input_ids=token_N[:, None], attention_mask=self.attention_N_L,
                          position_ids=self.position_N[:, None], past_key_values=self.cache,
                          use_cache=True).logits[:, -1]


def _distinct(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(the index of each distinct prompt's first occurrence, each prompt's index among the distinct ones)."""
    seen: dict[tuple[int, ...], int] = {}
    first, index = [], []
    for p, ids in enumerate(prompts):
        if tuple(ids) not in seen:
            seen[tuple(ids)] = len(first)
            first.append(p)
        index.append(seen[tuple(ids)])
    return first, index


def sample_next(logits_B_V: torch.Tensor, params: SamplingParams,
                uniform_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the temperature-scaled distribution, drawn by inverse CDF
    with the row's uniform number in [0, 1) (`torch.multinomial` would draw one per vocabulary entry).

    Greedy (temperature 0) takes the argmax and reports its log-prob at temperature 1. top-k / top-p
    restrict what can be drawn, not the reported log-prob (it is the full distribution's, which is what
    the trainer recomputes).
    """
    if params.greedy:
        token_B = logits_B_V.argmax(-1)
        return token_B, token_logp(logits_B_V, token_B)
    if params.temperature != 1.0:
        logits_B_V = logits_B_V / params.temperature
    logz_B_1 = logits_B_V.logsumexp(-1, keepdim=True)
    allowed_B_V = logits_B_V
    if params.top_k > 0 and params.top_k < logits_B_V.shape[-1]:
        kth_B_1 = logits_B_V.topk(params.top_k, dim=-1).values[:, -1:]
        allowed_B_V = allowed_B_V.masked_fill(logits_B_V < kth_B_1, float("-inf"))
    if params.top_p < 1.0:
        sorted_B_V, order_B_V = allowed_B_V.sort(dim=-1, descending=True)
        probs_sorted_B_V = sorted_B_V.softmax(-1)
        # drop a token when the more likely tokens already hold top_p of the mass
        drop_sorted_B_V = probs_sorted_B_V.cumsum(-1) - probs_sorted_B_V >= params.top_p
        drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter(-1, order_B_V, drop_sorted_B_V)
        allowed_B_V = allowed_B_V.masked_fill(drop_B_V, float("-inf"))
    # unnormalised where top-k / top-p removed mass: u is scaled by the total
    cdf_B_V = (allowed_B_V - logz_B_1).exp_().cumsum(-1)
    u_B_1 = uniform_B[:, None] * cdf_B_V[:, -1:]
    token_B = torch.searchsorted(cdf_B_V, u_B_1, right=True).squeeze(-1).clamp(max=cdf_B_V.shape[-1] - 1)
    return token_B, logits_B_V.gather(-1, token_B[:, None]).squeeze(-1) - logz_B_1.squeeze(-1)
