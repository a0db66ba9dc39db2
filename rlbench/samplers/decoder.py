"""A compact decode path for Llama-family models (Qwen2, Qwen3, Llama): the sampler's hot loop.

At the sizes rlbench trains on a CPU, a decode step costs more in per-module Python overhead than in
arithmetic. This path computes exactly the transformers forward (same formulas, fp32 accumulation
in RMSNorm, the model's own rotary tables) with fused q/k/v and gate/up projections, a KV cache
allocated once per call, and a padding mask updated in place, so a step is a few dozen tensor ops.
The weights are the transformers model's: `refresh()` re-fuses them after every weight load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def supports(model) -> bool:
    """True for models whose forward this path reproduces (full attention, SiLU MLP, RMSNorm)."""
    cfg = model.config
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (cfg.model_type in SUPPORTED_MODEL_TYPES and layer_types == {"full_attention"}
            and not getattr(cfg, "use_sliding_window", False) and cfg.hidden_act == "silu")


class CompactDecoder:
    def __init__(self, model):
        if not supports(model):
            raise ValueError(f"CompactDecoder supports {SUPPORTED_MODEL_TYPES} with full attention, "
                             f"not {model.config.model_type!r}")
        self.model = model
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read (and fuse) the model's current weights."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = self.model.lm_head.weight
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_bias = None
            if attn.q_proj.bias is not None:
                qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            self.layers.append(dict(
                in_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                qkv_bias=qkv_bias,
                q_norm=(attn.q_norm.weight, attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None,
                k_norm=(attn.k_norm.weight, attn.k_norm.variance_epsilon) if hasattr(attn, "k_norm") else None,
                o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight,
            ))

    @torch.no_grad()
    def start(self, ids_N_P: torch.Tensor, mask_N_P: torch.Tensor, max_new_tokens: int, n: int = 1) -> torch.Tensor:
        """Prefill N left-padded prompts once each, then give each prompt `n` rows (prompt-major, B = N·n);
        returns the logits `[B, V]` of the first new token."""
        N, P = ids_N_P.shape
        L = P + max_new_tokens
        device, dtype = self.embed.device, self.embed.dtype
        self.cache_K = torch.zeros(len(self.layers), N, self.kv_heads, L, self.head_dim, device=device, dtype=dtype)
        self.cache_V = torch.zeros_like(self.cache_K)
        position_N_P = (mask_N_P.cumsum(-1) - 1).clamp(min=0)
        # rotary tables for every position this call can reach, from the model's own rotary module
        all_positions_1_L = torch.arange(int(position_N_P.max()) + max_new_tokens + 1, device=device)[None]
        cos, sin = self.model.model.rotary_emb(self.embed[:1], all_positions_1_L)
        self.cos_L_D, self.sin_L_D = cos[0], sin[0]
        # a padded query attends to itself so that its (unused) output stays finite
        causal_P_P = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        allowed_N_P_P = (causal_P_P & mask_N_P.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
        logits_N_V = self._forward(ids_N_P, position_N_P, allowed_N_P_P[:, None], 0, last_only=True)[:, -1]
        if n > 1:  # [layers, N, ...] -> [layers, N·n, ...]
            self.cache_K, self.cache_V = self.cache_K.repeat_interleave(n, 1), self.cache_V.repeat_interleave(n, 1)
        self.valid_B_L = torch.zeros(N * n, L, dtype=torch.bool, device=device)
        self.valid_B_L[:, :P] = mask_N_P.bool().repeat_interleave(n, 0)
        self.length, self.position_B = P, position_N_P[:, -1].repeat_interleave(n, 0)
        return logits_N_V.repeat_interleave(n, 0)

    def keep(self, rows_b: torch.Tensor) -> None:
        """Go on with these rows of the batch only (finished rows cost nothing more)."""
        self.cache_K, self.cache_V = self.cache_K[:, rows_b], self.cache_V[:, rows_b]
        self.valid_B_L, self.position_B = self.valid_B_L[rows_b], self.position_B[rows_b]

    @torch.no_grad()
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        """Append one token per row; returns the logits `[B, V]` of the next one."""
        t = self.length
        self.valid_B_L[:, t] = True
        self.position_B = self.position_B + 1
        self.length = t + 1
        allowed_B_1_1_L = self.valid_B_L[:, None, None, : t + 1]
        return self._forward(token_B[:, None], self.position_B[:, None], allowed_B_1_1_L, t)[:, -1]

    def _forward(self, ids_B_S, position_B_S, allowed, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits `[B, S, V]` (`[B, 1, V]` of the last position when `last_only`), writing K/V at `start`."""
        B, S = ids_B_S.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        cos_B_1_S_D, sin_B_1_S_D = self.cos_L_D[position_B_S][:, None], self.sin_L_D[position_B_S][:, None]
        x_B_S_E = F.embedding(ids_B_S, self.embed)
        for i, w in enumerate(self.layers):
            qkv_B_S_F = F.linear(_rms_norm(x_B_S_E, *w["in_norm"]), w["qkv"], w["qkv_bias"])
            q, k, v = qkv_B_S_F.split([H * D, KV * D, KV * D], dim=-1)
            q_B_H_S_D = q.view(B, S, H, D).transpose(1, 2)
            k_B_K_S_D = k.view(B, S, KV, D).transpose(1, 2)
            if w["q_norm"] is not None:
                q_B_H_S_D, k_B_K_S_D = _rms_norm(q_B_H_S_D, *w["q_norm"]), _rms_norm(k_B_K_S_D, *w["k_norm"])
            q_B_H_S_D = _rope(q_B_H_S_D, cos_B_1_S_D, sin_B_1_S_D)
            self.cache_K[i, :, :, start : start + S] = _rope(k_B_K_S_D, cos_B_1_S_D, sin_B_1_S_D)
            self.cache_V[i, :, :, start : start + S] = v.view(B, S, KV, D).transpose(1, 2)
            end = start + S
            attn_B_H_S_D = F.scaled_dot_product_attention(
                q_B_H_S_D, self.cache_K[i, :, :, :end], self.cache_V[i, :, :, :end], attn_mask=allowed,
                enable_gqa=H != KV)
            x_B_S_E = x_B_S_E + F.linear(attn_B_H_S_D.transpose(1, 2).reshape(B, S, H * D), w["o"], w["o_bias"])
            gate, up = F.linear(_rms_norm(x_B_S_E, *w["post_norm"]), w["gate_up"]).chunk(2, dim=-1)
            x_B_S_E = x_B_S_E + F.linear(F.silu(gate) * up, w["down"])
        if last_only:
            x_B_S_E = x_B_S_E[:, -1:]
        return F.linear(_rms_norm(x_B_S_E, *self.final_norm), self.lm_head)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
