"""Long responses: the per-sample attention layout computes what each row's own forward computes, in memory
linear in the sequence length, and activation checkpointing leaves gradients unchanged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from floats import assert_close
from transformers import AutoModelForCausalLM

import rlbench as rl
from rlbench.batch import Batch, left_pad
from rlbench.policy import Critic, Policy, response_logits, response_outputs
from rlbench.policy.forward import (LOGIT_CHUNK_TOKENS, PACKED_MASK_BYTES, chunk_tokens_for, micro_batches,
                                    packed_mask_bytes, packing_pays, response_stats)
from rlbench.policy.training import OptimSettings

GRPO = rl.algorithms.get("grpo").replace(kl_coef=0.0)


def grouped_batch(prompts: list[list[int]], lengths: list[list[int]], *, shared: int, seed: int = 0) -> Batch:
    """Random responses, `lengths[g]` for the samples of prompt g; a group's samples share their first
    `shared` tokens (a shared response prefix) and differ after it."""
    g = torch.Generator().manual_seed(seed)
    rows, responses = [], []
    for prompt, group_lengths in zip(prompts, lengths):
        prefix = torch.randint(3, 250, (shared,), generator=g).tolist()
        for n in group_lengths:
            rows.append(prompt)
            responses.append((prefix + torch.randint(3, 250, (n,), generator=g).tolist())[:n])
    prompt_ids, prompt_mask = left_pad(rows, 0)
    T = max(map(len, responses))
    response_ids = torch.tensor([r + [0] * (T - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    advantages = torch.randn(len(rows), 1, generator=g) * response_mask
    return Batch(dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, advantages=advantages))


def own_row_outputs(model, batch: Batch) -> list[torch.Tensor]:
    """Each row through the model alone, unpadded: the outputs `[t, F]` that predict its t response tokens."""
    outputs = []
    for b in range(len(batch)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        response = batch["response_ids"][b][batch["response_mask"][b].bool()]
        out_L_F = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0]
        outputs.append(out_L_F[len(prompt) - 1 : len(prompt) + len(response) - 1])
    return outputs


def test_per_sample_outputs_and_gradients_equal_each_rows_own_forward(tiny):
    # 3 groups: 4 samples sharing a 3-token response prefix, 2 samples, 1 sample; lengths differ in a group.
    # The loss: a token-mean of advantage-weighted log-probs (a policy gradient's)
    model, _ = tiny
    batch = grouped_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[9, 4, 3, 7], [6, 2], [5]], shared=3)
    ids_B_T, mask_B_T, adv_B_T = batch["response_ids"], batch["response_mask"].bool(), batch["advantages"]
    model.zero_grad()
    per_sample_B_T_V = response_outputs(model, batch, "per_sample")
    logp_B_T = rl.algorithms.token_logp(per_sample_B_T_V, ids_B_T)
    ((logp_B_T * adv_B_T)[mask_B_T].sum() / mask_B_T.sum()).backward()
    per_sample_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    own = own_row_outputs(model, batch)
    own_logp = [rl.algorithms.token_logp(out[None], ids_B_T[b, None, : len(out)])[0] for b, out in enumerate(own)]
    (sum((logp * adv_B_T[b, : len(logp)]).sum() for b, logp in enumerate(own_logp)) / mask_B_T.sum()).backward()
    for b, out in enumerate(own):
        assert_close(per_sample_B_T_V[b, : len(out)], out, atol=1e-5)  # 1e-5: a batch vs a row alone
    for name, p in model.named_parameters():
        assert_close(per_sample_grads[name], p.grad, atol=1e-5, msg=name)  # 1e-5: a batch vs rows alone
    model.zero_grad(set_to_none=True)


def update_gradients(policy: Policy, batch: Batch) -> dict[str, torch.Tensor]:
    counts = dict(num_tokens=int(batch.tensors.get("loss_mask", batch["response_mask"]).sum()), num_seqs=len(batch),
                  norm_length=batch["response_ids"].shape[1])
    with torch.no_grad():
        batch = batch.with_columns(old_logp=policy.log_probs(batch) + 0.01)  # off-policy: ratios other than 1
    policy.forward_backward(batch, GRPO, **counts)
    grads = {name: p.grad.clone() for name, p in policy.model.named_parameters()}
    policy.optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("settings", [dict(attention="per_sample"),
                                      dict(attention="packed", activation_checkpointing=True),
                                      dict(attention="per_sample", activation_checkpointing=True)],
                         ids=["per_sample", "packed-checkpointed", "per_sample-checkpointed"])
def test_policy_gradients_with_loss_mask_holes_equal_the_packed_update(tiny_dir, settings):
    # multi-turn: loss_mask zeros inside the responses (tool output tokens), response_mask without holes
    batch = grouped_batch([[5, 6, 7], [8, 9]], [[12, 8, 10], [11, 5]], shared=2)
    loss_mask = batch["response_mask"].clone()
    loss_mask[:, 3:6] = 0
    batch = batch.with_columns(loss_mask=loss_mask)
    expected = update_gradients(Policy(tiny_dir, OptimSettings(lr=1e-3), attention="packed"), batch)
    got = update_gradients(Policy(tiny_dir, OptimSettings(lr=1e-3), **settings), batch)
    for name, grad in expected.items():
        # 1e-5 (and rtol): gradients summed in another layout, some recomputed under checkpointing
        assert_close(got[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_long_responses_run_per_sample_without_a_quadratic_tensor(tiny):
    # 8 samples of up to 2110 tokens: the packed layout would need a mask of over 1 GiB. Per-sample, no op
    # sees a tensor with two dimensions of a sequence's length (an L x L mask or score matrix), and the largest
    # allocation is linear in the tokens: the MLP's activations, 8 x 2110 x 768 fp32 (~50 MiB; one row's
    # 2110 x 2110 scores would already be 17 MiB, all rows' 136 MiB)
    model, _ = tiny
    batch = grouped_batch([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], [[2100, 2050, 2100, 1900, 2100, 2000, 2100, 2080]],
                          shared=4)
    assert packed_mask_bytes(batch) > 2**30 > PACKED_MASK_BYTES
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True, record_shapes=True) as profile:
        auto_B_T_V = response_outputs(model, batch)  # auto: per-sample at this size
    events = profile.events()
    square = [(event.name, shape) for event in events for shape in event.input_shapes
              if isinstance(shape, list) and sum(isinstance(d, int) and d >= 1900 for d in shape) >= 2]
    assert not square
    assert 0 < max(event.cpu_memory_usage for event in events) <= 8 * 2110 * 768 * 4
    with torch.no_grad():
        own = own_row_outputs(model, batch[:2])
    for b, out in enumerate(own):
        assert_close(auto_B_T_V[b, : len(out)], out, atol=1e-5)  # 1e-5: a batch vs a row alone


def test_auto_packs_where_packing_pays(tiny, rollout):
    model, _ = tiny
    # the quickstart's shapes (4 prompts x 4 samples of up to 8 tokens), a long prompt shared by short answers
    assert packing_pays(model, rollout)
    assert packing_pays(model, grouped_batch([list(range(5, 205))], [[8] * 8], shared=0))
    # 8 samples of 128 tokens to a 10-token prompt: packed takes ~1000 x 1000 pairs, per-sample 8 x 138²
    # (measured: forward + backward 0.12 s packed, 0.074 s per-sample)
    assert not packing_pays(model, grouped_batch([list(range(5, 15))], [[128] * 8], shared=0))
    # the same samples sharing their first 120 tokens (a tool loop's samples often do): packed holds 10 + 120 + 8 x 8
    # tokens, per-sample 8 x 138 (measured: 0.018 s packed, 0.078 s per-sample)
    assert packing_pays(model, grouped_batch([list(range(5, 15))], [[128] * 8], shared=120))


def test_an_attention_that_ignores_the_mask_is_refused_on_the_packed_path(tiny_dir, rollout):
    model = rl.models.from_pretrained(AutoModelForCausalLM, tiny_dir, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="attention='packed' needs an attention implementation that honours"):
        response_outputs(model, rollout, "packed")
    assert not packing_pays(model, rollout)  # auto: per-sample


def test_activation_checkpointing_keeps_only_each_blocks_input(tiny_dir, rollout):
    def saved_bytes(policy: Policy) -> int:
        saved = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            response_outputs(policy.model, rollout, "packed")
        return sum(saved)
    plain = saved_bytes(Policy(tiny_dir, OptimSettings(lr=1e-3)))
    checkpointed = saved_bytes(Policy(tiny_dir, OptimSettings(lr=1e-3), activation_checkpointing=True))
    assert checkpointed < plain / 2


def test_critic_values_are_the_same_in_both_layouts(tiny_dir, rollout):
    values = [Critic(tiny_dir, OptimSettings(lr=1e-3), attention=attention).values(rollout)
              for attention in ("packed", "per_sample")]
    assert_close(values[1], values[0], atol=1e-5)  # 1e-5: packed vs per-sample attention


def test_a_session_trains_the_same_per_sample_and_checkpointed(tiny_dir):
    weights = []
    for settings in (dict(attention="packed"), dict(attention="per_sample", activation_checkpointing=True)):
        with rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
                        samples_per_prompt=4, max_new_tokens=8, log_dir=None, seed=5, **settings) as s:
            s.run(2, progress=False)
            weights.append(s.policy.state_dict())
    for name, weight in weights[0].items():
        assert_close(weights[1][name], weight, atol=1e-5, msg=name)  # 1e-5: 2 steps, gradients in another layout


@pytest.mark.slow
def test_the_long_responses_benchmark_runs_both_paths_in_quick_mode():
    # the benchmark's smoke setting (~1 min: four fresh processes): a ~0.1M no-EOS model, responses of 16 and 32 tokens, one step per run
    script = Path(__file__).parent.parent / "benchmarks" / "long_responses.py"
    env = os.environ | {"PYTHONPATH": str(script.parent.parent), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), "--quick", "--lengths", "16,32"], cwd=script.parent, env=env,
                         capture_output=True, text=True, check=True, timeout=300).stdout
    *rows, summary = [json.loads(line) for line in out.splitlines()]
    assert [(r["path"], r["response_tokens"]) for r in rows] == [
        ("packed", 16), ("per_sample", 16), ("packed", 32), ("per_sample", 32)]
    for row in rows:
        assert not row.get("skipped")
        assert row["rollout_s"] > 0 and row["update_s"] > 0 and row["old_logp_s"] > 0 and row["peak_rss_mb"] > 0
        # one 48-token prompt and 8 samples of L tokens, no shared prefix: a row W = 48 + 8 L wide, 4 W² bytes
        assert row["packed_width"] == 48 + 8 * row["response_tokens"]
        assert row["packed_mask_mb"] == round(4 * row["packed_width"] ** 2 / 2**20, 1)
    assert summary["summary"] and summary["per_sample"]["lengths"] == [16, 32]
    assert set(summary["per_sample"]["exponents"]) >= {"update_s", "peak_rss_mb", "rollout_us_per_token"}


@pytest.mark.parametrize("attention", ["packed", "per_sample"])
def test_chunked_head_gives_the_log_probs_entropies_and_gradients_of_the_whole_logits(tiny, attention):
    # chunks of 5 tokens (not dividing the batch's B·T = 6 x 12 positions), temperature 0.7; the loss uses both
    # statistics, so the entropy's gradient flows through the recomputed chunks too
    model, _ = tiny
    batch = grouped_batch([[5, 6, 7], [8, 9]], [[12, 8, 10], [11, 5, 3]], shared=2)
    mask_B_T, adv_B_T = batch["response_mask"].bool(), batch["advantages"]

    def statistics_and_grads(chunk_tokens: int):
        model.zero_grad()
        if chunk_tokens:
            logp_B_T, entropy_B_T = response_stats(model, batch, temperature=0.7, chunk_tokens=chunk_tokens,
                                                   attention=attention).unbind(-1)
        else:
            logits_B_T_V = response_logits(model, batch, 0.7, attention)
            logp_B_T = rl.algorithms.token_logp(logits_B_T_V, batch["response_ids"])
            entropy_B_T = rl.algorithms.entropy_from_logits(logits_B_T_V)
        ((logp_B_T * adv_B_T + 0.1 * entropy_B_T)[mask_B_T].sum() / mask_B_T.sum()).backward()
        return logp_B_T.detach(), entropy_B_T.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    whole, chunked = statistics_and_grads(0), statistics_and_grads(5)
    model.zero_grad(set_to_none=True)
    # 1e-5 (and rtol): the head's matmul over other shapes of rows, summed in another order
    assert_close(chunked[0][mask_B_T], whole[0][mask_B_T], atol=1e-5, rtol=1e-5)
    assert_close(chunked[1][mask_B_T], whole[1][mask_B_T], atol=1e-5, rtol=1e-5)
    for name, grad in whole[2].items():
        assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert type(model.get_output_embeddings()).forward is model.get_output_embeddings().forward.__func__  # restored


def test_chunked_head_never_holds_a_micro_batchs_logits(tiny_dir):
    # 4 rows of 300 response tokens: the whole head keeps 1200 x V logits (and their softmax) for the backward; in
    # chunks of 64 tokens nothing over the vocabulary is kept, each chunk's logits are recomputed in the backward.
    # Then the update through `Policy.forward_backward`: the gradients of the whole head
    batch = grouped_batch([[5, 6, 7]], [[300] * 4], shared=0)
    policy = Policy(tiny_dir, OptimSettings(lr=1e-3), attention="per_sample", logit_chunk_tokens=64)
    vocab = policy.model.config.vocab_size

    def kept_over_the_vocabulary(chunk_tokens: int) -> list[int]:
        kept = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.shape[-1] == vocab:
                kept.append(tensor.numel() // vocab)
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            if chunk_tokens:
                response_stats(policy.model, batch, temperature=1.0, chunk_tokens=chunk_tokens, attention="per_sample")
            else:
                logits_B_T_V = response_logits(policy.model, batch, 1.0, "per_sample")
                rl.algorithms.token_logp(logits_B_T_V, batch["response_ids"])
                rl.algorithms.entropy_from_logits(logits_B_T_V)
        return kept
    assert max(kept_over_the_vocabulary(0)) >= 1200  # the whole head: every position's logits are kept
    assert kept_over_the_vocabulary(64) == []
    plain, chunked = (update_gradients(Policy(tiny_dir, OptimSettings(lr=1e-3), attention="per_sample",
                                              logit_chunk_tokens=chunk), batch) for chunk in (0, 64))
    for name, grad in plain.items():
        assert_close(chunked[name], grad, atol=1e-5, rtol=1e-5, msg=name)  # the loss through policy.forward_backward


def test_logit_chunks_auto_turn_on_where_a_micro_batchs_logits_pass_a_gibibyte():
    assert chunk_tokens_for(None, 4096, 259) == 0  # tiny-arith: 4 MiB of logits
    assert chunk_tokens_for(None, 32768, 151936) == LOGIT_CHUNK_TOKENS  # the GSM8K recipe: 18.5 GiB
    assert chunk_tokens_for(0, 32768, 151936) == 0 and chunk_tokens_for(512, 64, 259) == 512
    with pytest.raises(ValueError, match="logit_chunk_tokens=-1"):
        chunk_tokens_for(-1, 4096, 259)


def test_packed_micro_batches_count_what_the_packed_layout_holds(tiny_dir):
    """Micro-batches laid out packed are cut by the tokens that layout holds (each group's prompt once, then its
    responses), not by rows x padded length: two groups of 8 short answers to a 100-token prompt (180 tokens each,
    880 padded) fit one 400-token micro-batch; per sample they take six. Cut by the packed count, rows whose
    packed layout would not pay are cut again by the padded count; the log-probs are the same either way."""
    model = rl.models.load(tiny_dir)[0]
    batch = grouped_batch([list(range(5, 105)), list(range(7, 107))], [[10] * 8, [10] * 8], shared=0)
    assert [len(m) for m in micro_batches(batch, 400)] == [3, 3, 3, 3, 3, 1]
    assert [len(m) for m in micro_batches(batch, 400, packs=lambda micro: True)] == [16]
    assert [len(m) for m in micro_batches(batch, 400, packs=lambda micro: len(micro) < 16)] == [3, 3, 3, 3, 3, 1]
    assert [len(m) for m in micro_batches(batch, 100 + 8 * 10, packs=lambda micro: True)] == [8, 8]
    assert packing_pays(model, batch)
    logp = {attention: Policy(tiny_dir, OptimSettings(lr=1e-3), micro_batch_tokens=400, attention=attention)
            .log_probs(batch) for attention in ("auto", "per_sample")}  # one packed micro-batch; six per sample
    assert_close(logp["auto"], logp["per_sample"])
