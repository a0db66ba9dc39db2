"""LoRA RL: only the adapter trains and sits in the optimizer; the sampler takes the adapter alone and then samples
exactly what the policy computes; the reference is the policy with its adapter off (no second copy of the weights);
checkpoints hold the adapter and resume bit for bit; export writes the merged model or the peft adapter."""

import re

import pytest
import torch
from floats import assert_close
from transformers import AutoModelForCausalLM

import rlbench as rl
from rlbench.models import lora as lora_adapters
from rlbench.policy import Policy
from rlbench.policy.training import OptimSettings
from rlbench.samplers import HFSampler, SamplingParams

SMALL = dict(model="tiny-arith", task="arithmetic", cluster="inline", prompts_per_step=4, samples_per_prompt=4,
             max_new_tokens=8, threads=1, seed=5, log_dir=None, lora=rl.LoRA(rank=8, alpha=16))
PROMPTS = ["12+34=", "7+5=", "99+9=", "3+40=", "61+7="]


def _policy(session) -> Policy:
    return session.policy.workers.hosts[0].objects["policy"]


def _scramble_adapter(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Random non-zero adapters (B starts at 0, so a fresh adapter changes nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


def _greedy(model, tokenizer, prompts, steps=6) -> list[list[int]]:
    """A plain greedy loop over the full forward (no cache, no sampler code)."""
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        drawn = []
        with torch.no_grad():
            for _ in range(steps):
                token = int(model(input_ids=torch.tensor([ids + drawn])).logits[0, -1].argmax())
                drawn.append(token)
                if token == tokenizer.eos_token_id:
                    break
        out.append(drawn)
    return out


def _bytes_held(objects: dict) -> int:
    """Bytes of the distinct tensor storages behind every module the worker's objects hold."""
    storages = {}
    for obj in objects.values():
        for value in vars(obj).values():
            if isinstance(value, torch.nn.Module):
                for tensor in [*value.parameters(), *value.buffers()]:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_only_the_adapter_trains_and_only_it_is_in_the_optimizer():
    with rl.Session(**SMALL, lr=1e-3) as s:
        policy = _policy(s)
        adapter = {n for n, p in policy.model.named_parameters() if p.requires_grad}
        assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
        # all-linear: every projection of every block, not the LM head or the embedding
        assert len(adapter) == 2 * 7 * policy.model.config.num_hidden_layers
        base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
        s.run(2, progress=False)
        optimized = {id(p) for group in policy.optimizer.adamw.param_groups for p in group["params"]}
        assert optimized == {id(p) for n, p in policy.model.named_parameters() if n in adapter}
        assert {id(p) for p in policy.optimizer.adamw.state} == optimized  # AdamW's moments: the adapter's only
        for name, p in policy.model.named_parameters():
            if name in base:
                assert torch.equal(p, base[name]), name
        assert any(p.abs().sum() > 0 for n, p in policy.model.named_parameters() if ".lora_B." in n)


def test_the_sync_carries_the_adapter_alone_and_the_sampler_then_samples_the_policy():
    with rl.Session(**SMALL) as s:
        policy = _policy(s)
        _scramble_adapter(policy.model, seed=1)
        sent = s.policy.state_dict()
        assert set(sent) == {n for n, p in policy.model.named_parameters() if p.requires_grad}
        full_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
        assert sum(t.numel() * t.element_size() for t in sent.values()) < full_bytes / 5
        s.sync_weights()
        tokenizer = s.tokenizer
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        greedy = s.sampler.generate_ids(prompt_ids, SamplingParams(max_new_tokens=6, temperature=0.0))
        expected = _greedy(policy.model, tokenizer, PROMPTS)
        with policy.model.disable_adapter():
            base = _greedy(policy.model, tokenizer, PROMPTS)
        assert expected != base  # the adapter changes what is drawn ...
        got = [ids[mask.bool()].tolist() for ids, mask in zip(greedy["response_ids"], greedy["response_mask"])]
        assert got == expected  # ... and the sampler draws what the policy computes
        batch = s.rollout()
        logp = s.policy.log_probs(batch)
        mask = batch["response_mask"].bool()
        assert_close(logp[mask], batch["sampler_logp"][mask], atol=1e-5)  # 1e-5: a decode loop vs a forward


def test_the_reference_is_the_policy_with_its_adapter_off_and_no_second_copy(tiny_dir):
    with rl.Session(**SMALL | dict(lora=None), algorithm="grpo") as full:
        full_bytes = _bytes_held(full.policy.workers.hosts[0].objects)
    with rl.Session(**SMALL, algorithm="grpo") as s:
        assert s.algorithm.needs_reference and s.reference is not None
        assert [g.name for g in s.workers.groups if g.name == "reference"] == []
        objects = s.policy.workers.hosts[0].objects
        assert list(objects) == ["policy"]
        lora_bytes = _bytes_held(objects)
        _scramble_adapter(_policy(s).model, seed=2)
        batch = s.rollout()
        ref_logp = s.reference.log_probs(batch)
        assert not torch.allclose(ref_logp, s.policy.log_probs(batch))  # the adapter is on in the policy
    base = rl.policy.Reference(tiny_dir)
    assert_close(ref_logp, base.log_probs(batch))
    base_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())
    assert full_bytes > 1.9 * base_bytes  # without LoRA the policy's process holds policy and reference
    assert lora_bytes < 1.2 * base_bytes, (lora_bytes, base_bytes)


def test_a_resumed_lora_run_is_the_uninterrupted_run_bit_for_bit_and_its_checkpoint_holds_the_adapter(tmp_path):
    def numbers(metrics):
        return metrics.drop(columns=[c for c in metrics.columns if c.startswith("time_")])

    with rl.Session(**SMALL, lr=1e-3) as whole:
        expected = whole.run(4, progress=False)
        expected_adapter = whole.policy.state_dict()
        base_bytes = sum(p.numel() * p.element_size() for p in _policy(whole).model.parameters())
    with rl.Session(**SMALL, lr=1e-3) as first:
        first.run(2, progress=False)
        folder = first.save(tmp_path / "ckpt")
    saved = sum(f.stat().st_size for f in (folder / "policy").iterdir())
    assert saved < base_bytes / 3  # the adapter and its AdamW moments, not the base
    with rl.Session.restore(folder) as second:
        assert second.config.lora == rl.LoRA(rank=8, alpha=16)
        metrics = second.run(2, progress=False)
        adapter = second.policy.state_dict()
    assert numbers(metrics).equals(numbers(expected))  # the restored history, then the same two steps
    assert adapter.keys() == expected_adapter.keys()
    for name, value in expected_adapter.items():
        assert torch.equal(adapter[name], value), name


def test_export_writes_the_merged_model_or_the_peft_adapter(tmp_path, tiny_dir):
    from peft import PeftModel

    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    with rl.Session(**SMALL) as s:
        policy = _policy(s)
        _scramble_adapter(policy.model, seed=3)
        with torch.no_grad():
            expected = policy.model(input_ids=ids).logits
        merged = s.export(tmp_path / "merged")
        adapter = s.export(tmp_path / "adapter", adapter=True)
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in name for name in plain.state_dict())
    with torch.no_grad():
        assert_close(plain(input_ids=ids).logits, expected, atol=1e-5)  # 1e-5: merged weights, rounded once
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), adapter)
    with torch.no_grad():
        assert_close(with_adapter(input_ids=ids).logits, expected, atol=1e-5)  # 1e-5: PEFT's adapter forward


def test_export_of_an_adapter_needs_a_lora_session(tmp_path):
    with rl.Session(**SMALL | dict(lora=None)) as s:
        with pytest.raises(ValueError, match="needs a LoRA session"):
            s.export(tmp_path / "adapter", adapter=True)


def test_activation_checkpointing_gives_a_lora_policy_the_same_gradients(tiny_dir, rollout):
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    counts = dict(num_tokens=int(rollout["response_mask"].sum()), num_seqs=len(rollout), norm_length=8)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same adapter initialisation
        policy = Policy(tiny_dir, OptimSettings(lr=1e-3), lora=rl.LoRA(rank=4, alpha=8),
                        activation_checkpointing=checkpointing)
        _scramble_adapter(policy.model, seed=4)
        policy.forward_backward(rollout.with_columns(old_logp=policy.log_probs(rollout)), algorithm, **counts)
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert_close(grads[1][name], grads[0][name], rtol=1e-5)  # rtol 1e-5: recomputed under checkpointing


def test_the_hf_sampler_refuses_an_adapter_that_does_not_fit(tiny):
    model, tokenizer = tiny
    lora = rl.LoRA(rank=4, alpha=8)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, lora=lora)
    a = torch.zeros(4, model.config.hidden_size)
    b = torch.zeros(model.config.vocab_size, 4)
    with pytest.raises(ValueError, match="not a LoRA adapter tensor: 'model.layers.0.mlp.up_proj.weight'"):
        sampler.load_weights({"model.layers.0.mlp.up_proj.weight": a})
    with pytest.raises(ValueError, match="cannot apply LoRA to 'lm_head': it adapts a block's linear layers only"):
        sampler.load_weights({"base_model.model.lm_head.lora_A.default.weight": a,
                              "base_model.model.lm_head.lora_B.default.weight": b})
    with pytest.raises(ValueError, match="without both lora_A and lora_B"):
        sampler.load_weights({"base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": a})
    with pytest.raises(ValueError, match=r"q_proj changes a weight of shape \(7, 192\)"):
        sampler.load_weights({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": a,
                              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(7, 4)})


def test_lora_settings_from_a_recipe_table_and_through_a_checkpoint_record():
    cfg = rl.config.make_config(lora={"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]})
    assert cfg.lora == rl.LoRA(rank=16, alpha=32, target_modules=("q_proj", "v_proj"))
    record = cfg.to_record()
    assert record["lora"] == {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
    assert rl.Config.from_record(record).lora == cfg.lora
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rnak'\]; valid: rank, alpha"):
        rl.config.make_config(lora={"rnak": 16})
    with pytest.raises(ValueError, match="dropout=0.1: only 0"):
        rl.LoRA(dropout=0.1)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        rl.LoRA(rank=0)


def test_merged_state_is_the_base_plus_the_scaled_product():
    lora = rl.LoRA(rank=2, alpha=6)  # scaling 3
    A, B, W = torch.ones(2, 3), torch.full((4, 2), 0.5), torch.zeros(4, 3)
    state = {"base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": W,
             "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": A,
             "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight": B,
             "base_model.model.lm_head.weight": torch.ones(2)}
    merged = lora_adapters.merged_state(state, lora)
    assert set(merged) == {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], torch.full((4, 3), 3.0))  # 3 · (0.5 · 1 · 2)


@pytest.mark.slow
def test_lora_grpo_learns_arithmetic():
    """The quickstart's setting with a rank-16 adapter at 5x the full-weight learning rate (measured at 100 steps,
    greedy held-out accuracy from 0.315: lr 5e-4 0.575, 1e-3 0.445, 3e-3 collapses to 0)."""
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0, log_dir=None,
                   prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, lr=5e-4, threads=1,
                   lora=rl.LoRA(rank=16, alpha=32))
    before = s.evaluate()["greedy_accuracy"]
    metrics = s.run(steps=100, progress=False)
    after = s.evaluate()["greedy_accuracy"]
    s.close()
    assert metrics["reward_mean"][-25:].mean() > metrics["reward_mean"][:25].mean()
    assert after > before + 0.1, (before, after)


def test_async_rollout_workers_take_the_adapter_mid_generation():
    """rollout_mode="async" pushes the adapter to the rollout worker after every update; with max_staleness=0 each
    batch is drawn by the weights it trains, so the sampler and the trainer agree as in a synchronous run."""
    with rl.Session(**SMALL, lr=1e-3, rollout_mode="async", max_staleness=0, correction=None) as s:
        metrics = s.run(3, progress=False)
        adapter = s.policy.state_dict()
        held = s.sampler.state_dict()
    assert metrics["staleness_max"].max() == 0
    assert metrics["sampler_mismatch_max"].max() < 1e-4
    assert held.keys() == adapter.keys() and all(torch.equal(held[k], adapter[k]) for k in adapter)


def test_restoring_with_another_adapter_is_refused_naming_what_differs(tmp_path):
    # the attack: another alpha was accepted (rescaling every trained delta), fewer target modules too (4 of 28 adapter
    # tensors kept); another rank, or no LoRA, was refused only by the shapes torch could not load
    with rl.Session(**SMALL) as s:
        s.step()
        folder = s.save(tmp_path / "ckpt")
    for lora, named in [(rl.LoRA(rank=8, alpha=32), r"an adapter trained with alpha=16"),
                        (rl.LoRA(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]),
                         r"an adapter trained with target_modules='all-linear'"),
                        (rl.LoRA(rank=4, alpha=16), r"an adapter trained with rank=8"),
                        (None, r"an adapter, LoRA\(rank=8, alpha=16")]:
        with pytest.raises(ValueError, match=rf"restore: lora={re.escape(repr(lora))}, but the checkpoint holds {named}"):
            rl.Session.restore(folder, lora=lora)
    with rl.Session.restore(folder, lora=rl.LoRA(rank=8, alpha=16)) as same:  # the saved one, given again
        assert same.step_count == 1
