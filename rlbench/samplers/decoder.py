"""A compact decode path for Llama-family models (Qwen2, Qwen3, Llama): the sampler's hot loop.

At the sizes rlbench trains on a CPU, a decode step costs more in per-module Python overhead than in
arithmetic. This path computes exactly the transformers forward (same formulas, fp32 accumulation
in RMSNorm, the model's own rotary tables) with fused q/k/v and gate/up projections, a KV cache with
one row per distinct context (see `keep`), an additive padding mask, and attention as plain matrix
products (on a CPU, `scaled_dot_product_attention` costs several times the arithmetic of a one-token
query), so a step is a few dozen tensor ops. The layer weights are transposed copies of the
transformers model's (the embedding and LM head are shared), re-read after every weight load (`refresh`); a
LoRA adapter is merged into those copies (`adapter`), so it costs nothing per token and the base stays untouched.
A prefill can start from K/V an earlier call kept (`contexts`, then `start`'s `cached_N`): an episode's next turn
computes only its new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlbench.models.lora import delta

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def supports(model) -> bool:
    """True for models whose forward this path reproduces (full attention, SiLU MLP, RMSNorm)."""
    cfg = model.config
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (cfg.model_type in SUPPORTED_MODEL_TYPES and layer_types == {"full_attention"}
            and not getattr(cfg, "use_sliding_window", False) and cfg.hidden_act == "silu")


class CompactDecoder:
    adaptable_layers = "a block's linear layers only (q, k, v, o, gate, up, down projections)"
    """What `adaptable` lists, in words (for the error naming a layer it cannot adapt)."""

    def __init__(self, model):
        if not supports(model):
            raise ValueError(f"CompactDecoder supports {SUPPORTED_MODEL_TYPES} with full attention, "
                             f"not {model.config.model_type!r}")
        self.model = model
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cos_sin_L_2_D = torch.empty(0)  # [positions, 2, D]: built by `start`
        # dynamic RoPE scaling rescales the tables by sequence length: rebuilt every call then
        self.dynamic_rope = "dynamic" in getattr(model.model.rotary_emb, "rope_type", "default")
        self.adapter: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora = None
        """A LoRA adapter, `{module path: (A, B)}` and its `rl.LoRA`, merged into the fused copies (`HFSampler.load_weights`):
        each adapted weight is read as W + s · B A, the model's own weights stay as they are."""
        self.refresh()

    def refresh(self) -> None:
        """The model's weights changed: re-read them at the next `start` (under `overlap_rollout`, that is in
        the background, while the update runs)."""
        self.layers = None

    @torch.no_grad()
    def _read_weights(self) -> None:
        """Fuse and transpose the model's current weights, each with its adapter merged in if it has one."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = self.model.lm_head.weight
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp

            def weight(block: str, name: str) -> torch.Tensor:
                module = getattr(attn if block == "self_attn" else mlp, name)
                pair = self.adapter.get(f"model.layers.{i}.{block}.{name}")
                if pair is None:
                    return module.weight
                return (module.weight.float() + delta(*pair, self.lora)).to(module.weight.dtype)

            qkv_bias = None
            if attn.q_proj.bias is not None:
                qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            self.layers.append(dict(
                in_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                qkv=torch.cat([weight("self_attn", n) for n in ("q_proj", "k_proj", "v_proj")]).t().contiguous(),
                qkv_bias=qkv_bias,
                qk_norm=_qk_norm(attn, self.heads, self.kv_heads),
                o=weight("self_attn", "o_proj").t().contiguous(), o_bias=attn.o_proj.bias,
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                gate_up=torch.cat([weight("mlp", n) for n in ("gate_proj", "up_proj")]).t().contiguous(),
                down=weight("mlp", "down_proj").t().contiguous(),
            ))

    def adaptable(self) -> dict[str, torch.Size]:
        """{module path: weight shape} of the linear layers an adapter may change (a block's q, k, v, o,
        gate, up and down projections)."""
        shapes = {}
        for i, layer in enumerate(self.model.model.layers):
            for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 ("mlp", ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    shapes[f"model.layers.{i}.{block}.{name}"] = getattr(getattr(layer, block), name).weight.shape
        return shapes

    @torch.no_grad()
    def start(self, ids_N_P: torch.Tensor, mask_N_P: torch.Tensor, max_new_tokens: int,
              cached_N: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
        """Prefill N left-padded prompts, one decoder row each; returns the logits `[N, V]` of the first new token.

        `cached_N`: per row, None or the K/V `[layers, KV, l, D]` of its prompt's first l tokens (fewer than
        the prompt's; from `contexts` of an earlier call on the same weights). They are copied in, and the
        forward runs from the first column that some row has no K/V for (rows with more cached tokens
        recompute the difference)."""
        if self.layers is None:
            self._read_weights()
        N, P = ids_N_P.shape
        L = P + max_new_tokens
        device, dtype = self.embed.device, self.embed.dtype
        position_N_P = (mask_N_P.cumsum(-1) - 1).clamp(min=0)
        # rotary tables for every position this call can reach (kept for later calls that reach no further),
        # from the model's own rotary module; the sine carries rotate_half's sign, so that a rotation is
        # x·cos + roll(x)·sin (see `_rope`)
        reach = int(position_N_P.max()) + max_new_tokens + 1
        if len(self.cos_sin_L_2_D) < reach or self.dynamic_rope:
            cos, sin = self.model.model.rotary_emb(self.embed[:1], torch.arange(reach, device=device)[None])
            half = self.head_dim // 2
            self.cos_sin_L_2_D = torch.stack([cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)], 1)
        # N rows of L positions; a row's positions past `self.length` are never read, so they start unset
        self.cache_K = torch.empty(len(self.layers), N, self.kv_heads, L, self.head_dim, device=device, dtype=dtype)
        self.cache_V = torch.empty_like(self.cache_K)
        first = self._copy_cached(mask_N_P, cached_N) if cached_N is not None else 0
        # queries at columns first..P-1 (S of them); a padded query attends to itself so that its (unused)
        # output stays finite
        query_S, key_P = torch.arange(first, P, device=device), torch.arange(P, device=device)
        allowed_N_S_P = (((key_P <= query_S[:, None]) & mask_N_P.bool()[:, None, :])
                         | (key_P == query_S[:, None]))
        logits_N_V = self._forward(ids_N_P[:, first:], position_N_P[:, first:], _additive(allowed_N_S_P, dtype),
                                   self.cache_K, self.cache_V, first, last_only=True)[:, -1]
        # generated positions are all attended to: only the prompts' padding is masked
        self.bias_N_L = torch.zeros(N, L, device=device, dtype=dtype)
        self.bias_N_L[:, :P] = _additive(mask_N_P.bool(), dtype)
        self.length, self.position_N = P, position_N_P[:, -1]
        return logits_N_V

    def _copy_cached(self, mask_N_P: torch.Tensor, cached_N: list) -> int:
        """Write each row's cached K/V into its columns (a row's tokens start after its left padding); returns
        the first column to compute: the earliest one that some row has no K/V for."""
        P = mask_N_P.shape[1]
        start_N = (P - mask_N_P.sum(-1)).tolist()
        first = min(start + (0 if kv is None else kv[0].shape[2]) for start, kv in zip(start_N, cached_N))
        if first == 0:  # a row without cached K/V fills the batch's width: everything is computed
            return 0
        # the padding columns before `first` are read (masked out): zeros, as finite as computed padding
        self.cache_K[..., :first, :].zero_()
        self.cache_V[..., :first, :].zero_()
        for n, (start, kv) in enumerate(zip(start_N, cached_N)):
            if kv is not None and start < first:  # columns from `first` on are computed anyway
                self.cache_K[:, n, :, start:first] = kv[0][:, :, : first - start]
                self.cache_V[:, n, :, start:first] = kv[1][:, :, : first - start]
        return first

    def contexts(self, rows_c: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of these rows' K/V `[layers, KV, l, D]` from their first real token to the last column written
        (what `start` takes back as a row's `cached_N` entry)."""
        first_c = (self.length - 1 - self.position_N[rows_c]).tolist()  # the last column holds position_N
        return [(self.cache_K[:, c, :, first : self.length].clone(), self.cache_V[:, c, :, first : self.length].clone())
                for c, first in zip(rows_c, first_c)]

    def keep(self, rows_c: torch.Tensor) -> None:
        """Go on with these rows of the batch, in this order; a row listed k times is copied k times (a
        context that branches), one left out costs nothing more.

        Only what changes is copied, since a long generation keeps rows at most every step: the same rows
        (every context drew one token) copy nothing; rows left out at the end leave a narrower view of the
        same cache; rows left out elsewhere move the rows after them down, in place. Only a branching (or
        reordering) step copies every kept row's written K/V into a new cache."""
        N, C = self.cache_K.shape[1], len(rows_c)
        order_c = torch.arange(C, device=rows_c.device)
        if C <= N and bool((rows_c == order_c).all()):  # the first C rows: no copy
            self.cache_K, self.cache_V = self.cache_K[:, :C], self.cache_V[:, :C]
            self.bias_N_L, self.position_N = self.bias_N_L[:C], self.position_N[:C]
            return
        if bool((rows_c[1:] > rows_c[:-1]).all()):  # rows left out: those after a gap move down in place
            moved_m = (rows_c != order_c).nonzero().squeeze(-1)
            from_m, t = rows_c[moved_m], self.length
            for cache in (self.cache_K, self.cache_V):  # only the written positions
                cache[:, moved_m, :, :t] = cache[:, from_m, :, :t]
            self.bias_N_L[moved_m] = self.bias_N_L[from_m]
            self.cache_K, self.cache_V = self.cache_K[:, :C], self.cache_V[:, :C]
            self.bias_N_L, self.position_N = self.bias_N_L[:C], self.position_N[rows_c]
            return
        for name in ["cache_K", "cache_V"]:  # only the written positions are copied
            cache = getattr(self, name)
            kept = cache.new_empty(cache.shape[0], len(rows_c), *cache.shape[2:])
            torch.index_select(cache[..., : self.length, :], 1, rows_c, out=kept[..., : self.length, :])
            setattr(self, name, kept)
        self.bias_N_L, self.position_N = self.bias_N_L[rows_c], self.position_N[rows_c]

    @torch.no_grad()
    def step(self, token_N: torch.Tensor) -> torch.Tensor:
        """Append one token per row; returns the logits `[N, V]` of the next one."""
        t = self.length
        self.position_N = self.position_N + 1
        self.length = t + 1
        return self._forward(token_N[:, None], self.position_N[:, None], self.bias_N_L[:, None, : t + 1],
                             self.cache_K, self.cache_V, t)[:, -1]

    def _forward(self, ids_B_S, position_B_S, bias_B_S_L, cache_K, cache_V, start: int,
                 last_only: bool = False) -> torch.Tensor:
        """Logits `[B, S, V]` (`[B, 1, V]` of the last position when `last_only`), writing K/V at `start` into
        the caches `[layers, B, KV, L, D]` and attending to their positions up to `start + S`."""
        B, S = ids_B_S.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        end = start + S
        cos_B_S_1_D, sin_B_S_1_D = self.cos_sin_L_2_D[position_B_S][..., None, :].unbind(2)
        x_B_S_E = F.embedding(ids_B_S, self.embed)
        for i, w in enumerate(self.layers):
            qkv_B_S_F = _linear(_rms_norm(x_B_S_E, *w["in_norm"]), w["qkv"], w["qkv_bias"])
            qk_B_S_N_D, v_B_S_K_D = qkv_B_S_F.view(B, S, H + 2 * KV, D).split([H + KV, KV], dim=2)
            if w["qk_norm"] is not None:
                qk_B_S_N_D = _rms_norm(qk_B_S_N_D, *w["qk_norm"])
            q_B_S_H_D, k_B_S_K_D = _rope(qk_B_S_N_D, cos_B_S_1_D, sin_B_S_1_D).split([H, KV], dim=2)
            cache_K[i, :, :, start:end] = k_B_S_K_D.transpose(1, 2)
            cache_V[i, :, :, start:end] = v_B_S_K_D.transpose(1, 2)
            attn_B_S_HD = _attention(q_B_S_H_D, cache_K[i, :, :, :end], cache_V[i, :, :, :end], bias_B_S_L)
            x_B_S_E += _linear(attn_B_S_HD, w["o"], w["o_bias"])
            gate, up = _linear(_rms_norm(x_B_S_E, *w["post_norm"]), w["gate_up"]).chunk(2, dim=-1)
            x_B_S_E += _linear(F.silu(gate, inplace=True).mul_(up), w["down"])
        if last_only:
            x_B_S_E = x_B_S_E[:, -1:]
        return F.linear(_rms_norm(x_B_S_E, *self.final_norm), self.lm_head)


def _linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the weight stored transposed (`[in, out]`): a plain product is faster on CPU at decode sizes."""
    return x @ w_t if bias is None else x @ w_t + bias


def _attention(q_B_S_H_D, k_B_K_L_D, v_B_K_L_D, bias_B_S_L) -> torch.Tensor:
    """Softmax attention `[B, S, H·D]` with an additive mask, as matrix products over the G = H / KV query
    heads that share a KV head (head h reads KV head h // G, like transformers' repeat_kv)."""
    B, S, H, D = q_B_S_H_D.shape
    KV, L = k_B_K_L_D.shape[1], k_B_K_L_D.shape[2]
    G = H // KV
    q_B_K_GS_D = q_B_S_H_D.view(B, S, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * S, D)
    scores_B_K_G_S_L = (q_B_K_GS_D @ k_B_K_L_D.transpose(-1, -2)).view(B, KV, G, S, L)
    scores_B_K_G_S_L = scores_B_K_G_S_L * D**-0.5 + bias_B_S_L[:, None, None]
    # softmax written out: torch's CPU softmax kernel is several times slower on rows this short
    exp_B_K_G_S_L = (scores_B_K_G_S_L - scores_B_K_G_S_L.amax(-1, keepdim=True)).exp()
    probs_B_K_GS_L = (exp_B_K_G_S_L / exp_B_K_G_S_L.sum(-1, keepdim=True)).view(B, KV, G * S, L)
    out_B_K_G_S_D = (probs_B_K_GS_L @ v_B_K_L_D).view(B, KV, G, S, D)
    return out_B_K_G_S_D.permute(0, 3, 1, 2, 4).reshape(B, S, H * D)


def _qk_norm(attn, heads: int, kv_heads: int) -> tuple[torch.Tensor, float] | None:
    """Qwen3's per-head q and k RMSNorms as one norm over the H + KV heads of q and k (None without them)."""
    if not hasattr(attn, "q_norm"):
        return None
    if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
        raise ValueError("CompactDecoder needs the same epsilon in q_norm and k_norm")
    weight_N_D = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
    return weight_N_D, attn.q_norm.variance_epsilon


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as an additive one: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in fp32, cast back, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, x·cos + rotate_half(x)·sin, with rotate_half's sign folded into the sine."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
