import dataclasses

import pytest
import torch
from floats import assert_close
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

import rlbench as rl
from rollout_checks import assert_rollout_layout
from rlbench.batch import left_pad
from rlbench.policy import batch_logp
from rlbench.samplers import HFSampler, SamplingParams, sample_next
from rlbench.samplers.decoder import CompactDecoder
from rlbench.samplers.hf import TransformersDecoder
from rlbench.samplers.kv_store import KVStore

# prompts of different lengths, so left padding and per-row positions are exercised
PROMPTS = ["12+34=", "7+5=", "99+99=", "3+40=", "50+6=", "1+1="]


def encode(tokenizer, texts):
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def generate_reference(model, tokenizer, rows, max_new_tokens):
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return out[:, ids.shape[1]:]


def with_prompts(out, rows, tokenizer, n=1):
    ids, mask = left_pad([r for r in rows for _ in range(n)], tokenizer.pad_token_id)
    return out.with_columns(prompt_ids=ids, prompt_mask=mask)


def decodes_like_transformers(model, tokenizer) -> HFSampler:
    """An HFSampler over `model` whose greedy tokens equal `generate`'s and whose sampled log-probs equal the
    model's recomputation (asserted); returned for checks of which decoder it chose."""
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = encode(tokenizer, PROMPTS)
    out = sampler.generate(rows, SamplingParams(max_new_tokens=8, temperature=0))
    assert torch.equal(out["response_ids"], generate_reference(model, tokenizer, rows, 8)[:, : out["response_ids"].shape[1]])
    sampled = sampler.generate(rows, SamplingParams(n=3, max_new_tokens=8, seed=0))
    recomputed = batch_logp(model, with_prompts(sampled, rows, tokenizer, 3), temperature=1.0, micro_batch_tokens=64)
    assert_close(sampled["sampler_logp"], recomputed, atol=1e-5)  # 1e-5: a decode loop vs a forward
    return sampler


def test_tiny_model_uses_the_compact_decoder(tiny):
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert isinstance(sampler.decoder, CompactDecoder)


def test_greedy_equals_transformers_generate(tiny):
    model, tokenizer = tiny
    rows = encode(tokenizer, PROMPTS)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = sampler.generate(rows, SamplingParams(max_new_tokens=10, temperature=0))
    expected = generate_reference(model, tokenizer, rows, 10)
    width = out["response_ids"].shape[1]
    # generate pads finished rows with pad after EOS, exactly like the sampler; beyond `width` only pads remain
    assert torch.equal(out["response_ids"], expected[:, :width])
    assert (expected[:, width:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("params", [
    SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=1),
    SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_k=5, seed=2),
    SamplingParams(n=4, max_new_tokens=12, temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(n=1, max_new_tokens=12, temperature=0),
])
def test_logp_equals_policy_recomputation(tiny, params):
    model, tokenizer = tiny
    rows = encode(tokenizer, PROMPTS)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = sampler.generate(rows, params)
    batch = with_prompts(out, rows, tokenizer, params.n)
    recomputed = batch_logp(model, batch, temperature=params.temperature or 1.0, micro_batch_tokens=64)
    assert out["sampler_logp"].abs().sum() > 0
    assert_close(out["sampler_logp"], recomputed, atol=1e-5)  # 1e-5: a decode loop vs a forward


def test_stop_mask_and_padding(tiny):
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = sampler.generate(encode(tokenizer, PROMPTS), SamplingParams(n=8, max_new_tokens=6, seed=0))
    assert_rollout_layout(out, tokenizer)


@pytest.mark.parametrize("decoder", [CompactDecoder, TransformersDecoder])
def test_each_row_draws_what_it_would_draw_alone(tiny, decoder):
    """Rows with the same context share one decoder row (the decoder branches where they draw apart): each
    row's tokens and log-probs must still be what the model's own forward on that row's context alone gives,
    drawn with that row's uniform number."""
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    sampler.decoder = decoder(model)
    rows, params = encode(tokenizer, PROMPTS), SamplingParams(n=8, max_new_tokens=8, seed=4)
    out = sampler.generate(rows, params)
    assert_rollout_layout(out, tokenizer)
    ids_B_T, mask_B_T = out["response_ids"], out["response_mask"].bool()
    B, T = ids_B_T.shape
    first_tokens = [set(ids_B_T[i : i + 8, 0].tolist()) for i in range(0, B, 8)]
    assert any(1 < len(tokens) < 8 for tokens in first_tokens)  # some rows share a context, then branch
    uniform_B_T = torch.rand(B, params.max_new_tokens, generator=torch.Generator().manual_seed(params.seed))
    for b in range(B):
        context = list(rows[b // params.n])
        for t in range(int(mask_B_T[b].sum())):
            with torch.no_grad():
                logits_1_V = model(torch.tensor([context])).logits[:, -1]
            token, logp = sample_next(logits_1_V, params, uniform_B_T[b, t : t + 1])
            assert int(token) == int(ids_B_T[b, t]), (b, t)
            assert abs(float(logp) - float(out["sampler_logp"][b, t])) < 1e-5, (b, t)
            context.append(int(token))
        assert bool(out["finished"][b]) == (context[-1] == tokenizer.eos_token_id)


@pytest.mark.parametrize("decoder", [CompactDecoder, TransformersDecoder])
def test_a_prompt_given_twice_is_prefilled_once_and_draws_as_alone(tiny, decoder, monkeypatch):
    """The same prompt given several times (an agentic step's first turns: one episode each, a seed each) takes one
    decoder row at the prefill, and each copy still draws exactly what it draws alone with its seed."""
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    sampler.decoder = decoder(model)
    a, b = encode(tokenizer, PROMPTS[:2])
    prompts, seeds = [a, b, a, a, b], (11, 12, 13, 14, 15)
    prefilled = []
    start = sampler.decoder.start
    monkeypatch.setattr(sampler.decoder, "start", lambda ids, *args, **kw: prefilled.append(len(ids)) or start(
        ids, *args, **kw))
    together = sampler.generate(prompts, SamplingParams(max_new_tokens=8, seeds=seeds))
    assert prefilled == [2]
    for row, (prompt, seed) in enumerate(zip(prompts, seeds)):
        alone = sampler.generate([prompt], SamplingParams(max_new_tokens=8, seeds=(seed,)))
        n = int(alone["response_mask"].sum())
        assert together["response_ids"][row, :n].tolist() == alone["response_ids"][0, :n].tolist(), row
        assert_close(together["sampler_logp"][row, :n], alone["sampler_logp"][0, :n])


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 1], [0, 2, 3], [1, 3], [0, 0, 2, 1]],
                         ids=["same", "last-left-out", "one-left-out", "two-left-out", "branching"])
def test_keep_goes_on_with_the_kept_rows_copying_only_to_branch(tiny, rows):
    # decode one token per prompt, keep `rows`, decode one more: the logits of prompts decoded alone in
    # that order. Rows only left out stay in the same cache (at long lengths a copy of every row's K/V each step
    # would cost more than the step); only a row kept twice (a branch) makes a new one
    model, tokenizer = tiny
    ids_N_P, mask_N_P = left_pad(encode(tokenizer, PROMPTS[:4]), tokenizer.pad_token_id)
    first_N, second_c = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11, 12])[: len(rows)]
    decoder, alone = CompactDecoder(model), CompactDecoder(model)
    decoder.start(ids_N_P, mask_N_P, 4)
    decoder.step(first_N)
    storage = decoder.cache_K.untyped_storage().data_ptr()
    decoder.keep(torch.tensor(rows))
    alone.start(ids_N_P[rows], mask_N_P[rows], 4)
    alone.step(first_N[rows])
    assert_close(decoder.step(second_c), alone.step(second_c), atol=1e-5)  # 1e-5: another batch
    assert (decoder.cache_K.untyped_storage().data_ptr() != storage) == (len(set(rows)) < len(rows))


def test_seeded_and_top_k_1_is_greedy(tiny):
    model, tokenizer = tiny
    rows = encode(tokenizer, PROMPTS)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    a = sampler.generate(rows, SamplingParams(n=8, seed=5, temperature=1.5))
    b = sampler.generate(rows, SamplingParams(n=8, seed=5, temperature=1.5))
    c = sampler.generate(rows, SamplingParams(n=8, seed=6, temperature=1.5))
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert not torch.equal(a["response_ids"], c["response_ids"])
    greedy = sampler.generate(rows, SamplingParams(temperature=0))
    top1 = sampler.generate(rows, SamplingParams(temperature=2.0, top_k=1, seed=9))
    assert torch.equal(greedy["response_ids"], top1["response_ids"])


def test_other_architectures_use_transformers_forward(tiny):
    _, tokenizer = tiny
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    assert isinstance(decodes_like_transformers(gpt2, tokenizer).decoder, TransformersDecoder)


def test_load_weights_changes_what_is_sampled(tiny_dir, tiny):
    _, tokenizer = tiny
    model, _ = rl.models.load(tiny_dir)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # a model whose only preference is the token "7": zero every weight, bias the final logits through
    # the (tied) embedding of the final norm's output
    forced = {k: torch.zeros_like(v) for k, v in state.items()}
    seven = tokenizer.convert_tokens_to_ids("7")
    forced["model.norm.weight"] = torch.ones_like(state["model.norm.weight"])
    forced["model.embed_tokens.weight"][seven] = 0.0
    forced["model.embed_tokens.weight"][:, 0] = 1.0
    forced["model.embed_tokens.weight"][seven, 0] = 50.0
    forced["lm_head.weight"] = forced["model.embed_tokens.weight"]
    sampler.load_weights(forced)
    out = sampler.generate(encode(tokenizer, PROMPTS), SamplingParams(n=4, max_new_tokens=5, seed=0))
    assert (out["response_ids"] == seven).all()
    sampler.load_weights(state)
    back = sampler.generate(encode(tokenizer, PROMPTS), SamplingParams(temperature=0, max_new_tokens=5))
    assert not (back["response_ids"] == seven).all()
    with pytest.raises(ValueError, match="unexpected"):
        sampler.load_weights(state | {"not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        sampler.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), not \(192,\)"):
        sampler.load_weights(state | {"model.norm.weight": torch.ones(3)})


def test_sampling_draws_from_the_tempered_distribution():
    # 20000 rows with the same logits: each token's frequency within 4 standard errors of its probability;
    # top-k never draws outside the k most likely
    logits_B_V = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    generator = torch.Generator().manual_seed(0)
    token_B, logp_B = sample_next(logits_B_V, SamplingParams(temperature=1.5), torch.rand(20000, generator=generator))
    p_V = (logits_B_V[0] / 1.5).softmax(-1)
    freq_V = torch.bincount(token_B, minlength=5) / len(token_B)
    assert ((freq_V - p_V).abs() <= 4 * (p_V * (1 - p_V) / len(token_B)).sqrt() + 1e-6).all()
    assert_close(logp_B, p_V.log()[token_B])
    top2_B, _ = sample_next(logits_B_V, SamplingParams(temperature=1.0, top_k=2), torch.rand(20000, generator=generator))
    assert set(top2_B.tolist()) == {0, 1}


def test_qwen3_per_head_norms_match_transformers(tiny):
    _, tokenizer = tiny
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    qwen3 = Qwen3ForCausalLM(config).eval()
    assert isinstance(decodes_like_transformers(qwen3, tokenizer).decoder, CompactDecoder)


def continued(rows, out, n, tail):
    """The next turn's prompts: each row of `out` that ended with a stop token, its prompt (rows[row // n])
    followed by its completion, stop token included, and `tail` (the rows that ran to max_new_tokens end)."""
    lengths = out["response_mask"].sum(-1).tolist()
    return [rows[b // n] + out["response_ids"][b, :lengths[b]].tolist() + tail
            for b in range(len(out)) if out["finished"][b]]


def prefill_widths(sampler, monkeypatch):
    """The number of columns of each prefill `sampler`'s compact decoder runs from now on."""
    widths, forward = [], sampler.decoder._forward

    def spy(ids_B_S, *args, last_only=False):
        if last_only:
            widths.append(ids_B_S.shape[1])
        return forward(ids_B_S, *args, last_only=last_only)
    monkeypatch.setattr(sampler.decoder, "_forward", spy)
    return widths


@pytest.mark.parametrize("n, temperature, next_n, next_temperature", [
    (1, 0.0, 1, 0.0), (3, 1.0, 2, 1.0), (3, 1.0, 1, 0.0), (1, 0.0, 4, 1.3)])
def test_kept_cache_gives_what_a_full_prefill_gives(tiny, monkeypatch, n, temperature, next_n, next_temperature):
    """A three-turn episode: each turn continues the contexts of the last turn's rows that stopped (plus a fresh
    prompt). With keep_cache the sampler prefills only the new tokens, and draws exactly what a fresh sampler
    without it draws from the whole contexts (per-prompt seeds: draws do not depend on the batch)."""
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = encode(tokenizer, PROMPTS)
    # 3 new tokens: "99+99=" and samples with long answers run out before their EOS
    out = sampler.generate(rows, SamplingParams(n=n, max_new_tokens=3, temperature=temperature,
                                                seeds=tuple(range(len(rows))), keep_cache=True))
    assert 0 < int(out["finished"].sum()) < len(out)
    widths = prefill_widths(sampler, monkeypatch)
    tail, fresh_prompt = encode(tokenizer, ["2+3=", "8+8="])
    for turn in [1, 2]:
        rows = continued(rows, out, n, tail) + [fresh_prompt]
        params = SamplingParams(n=next_n, max_new_tokens=4, temperature=next_temperature,
                                seeds=tuple(range(100 * turn, 100 * turn + len(rows))))
        out, n = sampler.generate(rows, dataclasses.replace(params, keep_cache=True)), next_n
        fresh = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        expected = fresh.generate(rows, params)
        assert torch.equal(out["response_ids"], expected["response_ids"])
        assert_close(out["sampler_logp"], expected["sampler_logp"], atol=1e-5)  # 1e-5: a kept cache vs a prefill
        # computed: the columns of the new tokens (the stop token and the tail; the fresh prompt is shorter)
        assert widths[-1] == len(tail) + 1 < max(map(len, rows))


def test_load_weights_clears_the_kept_cache(tiny_dir, tiny):
    """K/V kept under the old weights are not reused under new ones: the next turn equals a fresh sampler's."""
    _, tokenizer = tiny
    model, _ = rl.models.load(tiny_dir)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = encode(tokenizer, PROMPTS)
    out = sampler.generate(rows, SamplingParams(max_new_tokens=4, temperature=0, keep_cache=True))
    assert len(sampler.kept) > 0
    generator = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    sampler.load_weights(new)
    assert len(sampler.kept) == 0
    rows = continued(rows, out, 1, encode(tokenizer, ["2+3="])[0])
    params = SamplingParams(n=2, max_new_tokens=4, seeds=tuple(range(len(rows))))
    got = sampler.generate(rows, dataclasses.replace(params, keep_cache=True))
    fresh = HFSampler(rl.models.load(tiny_dir)[0], eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    fresh.load_weights(new)
    expected = fresh.generate(rows, params)
    assert torch.equal(got["response_ids"], expected["response_ids"])
    assert_close(got["sampler_logp"], expected["sampler_logp"], atol=1e-5)  # 1e-5: another batch's forward


def test_kept_cache_is_opt_in_and_bounded(tiny):
    """keep_cache=False keeps nothing (nor does the transformers path); a kept context is dropped once a call
    uses it, or after 2 calls that did not."""
    model, tokenizer = tiny
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows, params = encode(tokenizer, PROMPTS), SamplingParams(n=4, max_new_tokens=4, seed=0)
    sampler.generate(rows, params)
    assert len(sampler.kept) == 0
    transformers_path = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers_path.decoder = TransformersDecoder(model)
    transformers_path.generate(rows, dataclasses.replace(params, keep_cache=True))
    assert len(transformers_path.kept) == 0

    out = sampler.generate(rows, dataclasses.replace(params, keep_cache=True))
    kept = len(sampler.kept)
    # one entry per distinct context that stopped (samples that drew the same tokens share one)
    stopped = {tuple(rows[b // 4] + out["response_ids"][b, : int(out["response_mask"][b].sum()) - 1].tolist())
               for b in range(len(out)) if out["finished"][b]}
    assert kept == len(stopped) > 0
    first = continued(rows, out, 4, encode(tokenizer, ["1+1="])[0])[0]
    sampler.generate([first], SamplingParams(temperature=0, max_new_tokens=1, keep_cache=True))  # uses one
    assert len(sampler.kept) == kept - 1
    sampler.generate(rows, params)  # the second call since they were stored: they go
    assert len(sampler.kept) == 0


def test_kv_store_takes_the_longest_exact_prefix():
    store = KVStore()
    for ids in [[5, 6], [5, 6, 7, 8], [5, 6, 7, 9, 9]]:  # K/V filled with the length, to tell them apart
        kv = torch.full((1, 1, len(ids), 2), float(len(ids)))
        store.store(ids, kv, kv)
    found = store.take([[5, 6, 7, 8, 1], [5, 6, 7, 8], [5, 6, 7, 9, 8, 8], [6, 5, 7], [5]], torch.float32,
                       torch.device("cpu"))
    # the longest stored prefix; at least the last token left to compute; tokens compared exactly
    assert [None if kv is None else kv[0].shape[2] for kv in found] == [4, 2, 2, None, None]
    assert float(found[0][0].flatten()[0]) == 4.0
    assert len(store) == 1  # the ones given out are dropped: [5, 6, 7, 9, 9] is left
    store.take([[1, 2]], torch.bfloat16, torch.device("cpu"))  # another dtype: nothing kept fits
    assert len(store) == 0
