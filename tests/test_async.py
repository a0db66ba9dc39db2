"""rollout_mode="async": partial rollouts (weights taken mid-generation, each token's version), the staleness bound
under random worker speeds, the buffer in checkpoints, and a session that trains this way."""

import random
import threading
import time

import pytest
import torch
from floats import assert_close

import rlbench as rl
from rlbench.batch import left_pad
from rlbench.workers.cluster import WorkerGroup
from rlbench.policy import batch_logp
from rlbench.session.async_buffer import AsyncRollouts
from rlbench.samplers import HFSampler, Paced, PartialRollouts, SamplingParams, ScriptedSampler
from rlbench.workers import SamplerHandle

PROMPTS = ["12+34=", "7+5=", "99+99="]
SMALL = dict(model="tiny-arith", task="arithmetic", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
             cluster="inline", threads=1, log_dir=None)


def perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: other weights, so that versions are told apart by their log-probs."""
    generator = torch.Generator().manual_seed(seed)
    weights = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied, as the policy's are
    return weights


def logp_under(model, tokenizer, prompts, out, weights, temperature):
    """The log-prob of each token of `out` under `weights` (a policy forward of a copy of the model)."""
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(weights, strict=False)
    n = len(out) // len(prompts)
    ids, mask = left_pad([p for p in prompts for _ in range(n)], tokenizer.pad_token_id)
    batch = out.with_columns(prompt_ids=ids, prompt_mask=mask)
    return batch_logp(other, batch, temperature=temperature, micro_batch_tokens=4096)


def test_without_new_weights_a_rollout_is_the_samplers_own_generation(tiny):
    model, tokenizer = tiny
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=10, seeds=(1, 2, 3))
    plain = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = plain.generate(rows, params)
    out = PartialRollouts(plain).rollout(rows, params)
    width = expected["response_ids"].shape[1]
    for column in ("response_ids", "response_mask", "sampler_logp"):
        assert torch.equal(out[column][:, :width], expected[column]), column
    assert torch.equal(out["finished"], expected["finished"])
    assert int(out["token_version"].max()) == 0


def test_weights_that_arrive_mid_generation_draw_the_rest_of_each_row(tiny):
    """The push lands while the decoder computes the 4th token: tokens 0-3 are drawn by version 0, every later
    token by version 5, and each token's log-prob is that of the weights that drew it."""
    model, tokenizer = tiny
    import copy

    own = copy.deepcopy(model)
    sampler = HFSampler(own, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    partial = PartialRollouts(sampler)
    new = perturbed(model, 0.05, seed=0)
    steps, step = [0], sampler.decoder.step

    def step_and_push(token_N):
        steps[0] += 1
        if steps[0] == 3:  # after the 3rd token is drawn, while its logits are computed
            partial.push_weights(new, 5)
        return step(token_N)

    sampler.decoder.step = step_and_push
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=12, seeds=(1, 2, 3), temperature=2.0)  # long, varied answers
    out = partial.rollout(rows, params)
    mask = out["response_mask"].bool()
    versions = out["token_version"]
    assert (versions[:, :4][mask[:, :4]] == 0).all() and (versions[:, 4:][mask[:, 4:]] == 5).all()
    assert mask[:, 4:].any(), "no row went on past the push: the test would show nothing"
    assert partial.version == 5 and partial.stats["weight_loads"] == 1 and partial.stats["interrupted_rows"] > 0
    old_logp = logp_under(model, tokenizer, rows, out, model.state_dict(), 2.0)
    new_logp = logp_under(model, tokenizer, rows, out, new, 2.0)
    expected = torch.where(versions == 5, new_logp, old_logp)
    assert_close(out["sampler_logp"][mask], expected[mask], atol=1e-5)  # 1e-5: a decode loop vs a forward
    assert (new_logp - old_logp)[mask & (versions == 5)].abs().max() > 1e-3  # the two versions differ


def test_generate_goes_before_a_rollout_in_progress_with_the_newest_weights(tiny):
    """A held-out evaluation while a rollout runs: it goes in after the rollout's current token, with the weights just
    pushed, and the rollout goes on after it (no timing: the order of events, from seeded draws)."""
    model, tokenizer = tiny
    import copy

    sampler = HFSampler(copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    partial = PartialRollouts(sampler)
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    step, generate, running, calls, out = sampler.decoder.step, sampler.generate, threading.Event(), [], {}

    def step_and_signal(token_N):
        if not running.is_set():
            running.set()  # the rollout is drawing its 2nd token
            deadline = time.monotonic() + 60
            while not partial._waiting and time.monotonic() < deadline:  # the push and the call below arrive
                time.sleep(0.001)
        return step(token_N)

    def generate_and_record(*args, **kwargs):  # which caller each of the sampler's calls served
        calls.append(threading.current_thread().name)
        return generate(*args, **kwargs)

    sampler.decoder.step, sampler.generate = step_and_signal, generate_and_record
    background = threading.Thread(target=lambda: out.update(rollout=partial.rollout(rows, SamplingParams(
        n=2, max_new_tokens=16, temperature=3.0, seeds=(1, 2, 3)))), name="rollout")
    background.start()
    assert running.wait(60)
    new = perturbed(model, 0.05, seed=1)
    partial.push_weights(new, 1)
    greedy = partial.generate(rows[:1], SamplingParams(max_new_tokens=1, temperature=0))
    background.join()
    main = threading.current_thread().name
    assert calls[:2] == ["rollout", main] and calls[2:] == ["rollout"] * (len(calls) - 2) and len(calls) > 2, calls
    assert partial.version == 1
    expected = logp_under(model, tokenizer, rows[:1], greedy, new, 1.0)
    assert_close(greedy["sampler_logp"], expected, atol=1e-5)  # 1e-5: a decode loop vs a forward
    versions = out["rollout"]["token_version"]
    assert int(versions[:, 0].max()) == 0 and int(versions.max()) == 1  # begun under 0, finished under 1



def test_a_paced_sampler_draws_what_it_wraps_one_token_per_period(tiny):
    model, tokenizer = tiny
    import copy

    rows = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=12, seeds=(1, 2, 3), temperature=2.0)
    plain = HFSampler(copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    paced = Paced(HFSampler(copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id), seconds_per_token=0.02)
    expected = plain.generate(rows, params)
    start = time.perf_counter()
    out = paced.generate(rows, params)
    elapsed = time.perf_counter() - start
    for column in ("response_ids", "response_mask", "sampler_logp", "finished"):
        assert torch.equal(out[column], expected[column]), column
    assert elapsed >= 0.02 * out["response_ids"].shape[1]  # a lower bound: each decoding step waited its turn
    with pytest.raises(TypeError, match="Paced needs a sampler whose generate\\(\\) takes interrupt= .* not ScriptedSampler"):
        Paced(ScriptedSampler(tokenizer, lambda context: "1"), seconds_per_token=0.01)


def test_a_sampler_paced_by_the_trainer_gives_the_same_partial_rollouts_on_any_machine():
    """The sampler-bound regime of long responses, at toy size, stated in tokens (Paced(tokens_per_update=2)): every
    batch after the first was started under the weights before the ones that train it, drew 2 decoding steps under
    them and waited for the next: each row longer than 2 tokens is partial, exactly its first 2 tokens under version
    v - 1 and the rest under v, and no group is more than max_staleness = 1 update old. A second run on the same seed
    gives the same batches (nothing depends on which thread was faster)."""
    def run():
        paced = Paced(HFSampler.from_pretrained(rl.models.resolve("tiny-arith")), tokens_per_update=2)
        with rl.Session(**SMALL, sampler=paced, rollout=rl.Async(max_staleness=1)) as s:
            s.run(4)
            return s.last_batch, s.state.policy_version

    batch, now = run()
    mask = batch["response_mask"].bool()
    lengths = mask.sum(-1).tolist()
    for versions, valid, length in zip(batch["token_version"], mask, lengths):
        expected = [now - 2] * min(length, 2) + [now - 1] * max(length - 2, 0)
        assert versions[valid].tolist() == expected, (versions[valid].tolist(), expected)
    assert any(length > 2 for length in lengths), lengths  # some rows partial
    assert int(batch["staleness"].max()) == 1
    again, _ = run()
    for column in ("response_ids", "sampler_logp", "token_version"):
        assert torch.equal(again[column], batch[column]), column


def test_a_sampler_paced_by_the_trainer_is_refused_with_dynamic_sampling():
    """Dynamic sampling may take a group that the paced rollout holds waiting for weights: refused, named."""
    paced = Paced(HFSampler.from_pretrained(rl.models.resolve("tiny-arith")), tokens_per_update=2)
    with pytest.raises(ValueError, match="paced by the trainer .* dynamic sampling \\(algorithm 'dapo'\\)"):
        rl.Session(**SMALL, sampler=paced, rollout=rl.Async(max_staleness=1), algorithm="dapo")
    with pytest.raises(ValueError, match="tokens_per_update must be >= 1"):
        Paced(paced.sampler, tokens_per_update=0)

# ------------------------------------------------------------------------- the staleness bound
class SleepySampler:
    """A sampler that takes its time: a random pause per call and per token (interruptible, as the HF sampler is),
    answering with fixed tokens; weights change nothing but are loaded like a real sampler's."""

    def __init__(self, rng: random.Random, pad: int = 0, eos: int = 1):
        self.rng, self.pad_token_id, self.eos = rng, pad, eos

    def generate(self, prompt_ids, params, *, interrupt=None):
        time.sleep(self.rng.uniform(0, 0.01))
        B, T = len(prompt_ids) * params.n, params.max_new_tokens
        length = self.rng.randint(1, T)
        for t in range(length):
            time.sleep(self.rng.uniform(0, 0.002))
            if interrupt is not None and interrupt.is_set():
                length = t + 1
                break
        mask = torch.ones(B, length, dtype=torch.long)
        return rl.Batch({"response_ids": torch.full((B, length), 7), "response_mask": mask,
                         "sampler_logp": torch.zeros(B, length), "finished": torch.zeros(B, dtype=torch.bool)})

    def load_weights(self, weights):
        time.sleep(self.rng.uniform(0, 0.005))


class Tokenizer:
    """Just what SamplerHandle needs of a tokenizer here."""
    pad_token_id = 0
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3, 4, 5]

    def batch_decode(self, rows):
        return ["x" for _ in rows]


def sleepy_rollouts(rng: random.Random, K: int, P: int, workers: int, monkeypatch) -> AsyncRollouts:
    """AsyncRollouts over `workers` inline workers with SleepySamplers of random speeds; prompts "p0", "p1", ..."""
    monkeypatch.setattr(rl.tasks, "encode_prompt", lambda tokenizer, prompt: [3, 4, 5])

    def start(i: int) -> SamplerHandle:
        group = WorkerGroup(f"rollout-{i}", 1, ray=False, threads=None)
        speed = random.Random(rng.random())
        group.build("sampler", lambda: PartialRollouts(SleepySampler(speed)), [{}])
        return SamplerHandle(group, Tokenizer(), "SleepySampler", "a test's sampler of random speed")

    drawn = iter(range(10**6))
    return AsyncRollouts(
        [start(i) for i in range(workers)], max_staleness=K, groups_per_step=P,
        draw=lambda: ({"prompt": f"p{next(drawn)}"}, 0), restart=start,
        sample=lambda handle, tickets, v, trained_by: handle.rollout([t.example for t in tickets], SamplingParams(
            n=2, max_new_tokens=6, seeds=tuple(t.seed for t in tickets)), v, trained_by))


@pytest.mark.parametrize("case", range(16))
def test_no_group_is_trained_more_than_max_staleness_updates_after_its_first_token(case, monkeypatch):
    """Random worker counts and speeds, random trainer speeds, K in 0..3, and steps that take extra groups (dynamic
    sampling) at random: every taken group's oldest token is at most K versions old, the groups come in ticket
    order, none lost or repeated, and nothing waits forever."""
    rng = random.Random(case)
    K, P = rng.randint(0, 3), rng.randint(1, 4)
    rollouts = sleepy_rollouts(rng, K, P, rng.randint(1, 3), monkeypatch)
    tickets, batches, failures = [], [], []

    def train():
        version = 0
        for step in range(12):
            for _ in range(1 + (rng.random() < 0.3) * rng.randint(1, 2)):  # dynamic sampling's extra rounds
                batch = rollouts.take(P)
                oldest = batch["token_version"].masked_fill(batch["response_mask"] == 0, 10**9).amin(-1)
                assert int(version - oldest.min()) <= K, f"step {step}: staleness {int(version - oldest.min())} > {K}"
                tickets.extend(batch["ticket"][::2].tolist())
                batches.append(batch)
            time.sleep(rng.uniform(0, 0.03))  # the update
            version += 1
            rollouts.push({}, version)

    def run():
        try:
            train()
        except BaseException as error:
            failures.append(error)

    trainer = threading.Thread(target=run)
    trainer.start()
    trainer.join(60)
    rollouts.close()
    rollouts.join()
    assert not trainer.is_alive(), f"the trainer waited forever for ticket {len(tickets)} (K={K}, P={P})"
    assert not failures, failures[0]
    assert tickets == list(range(len(tickets)))
    last = batches[-1]["ticket"][::2].tolist()
    assert [e["prompt"] for e in batches[-1]["example"][::2]] == [f"p{i}" for i in last]


def test_no_ticket_starts_while_sampling_is_paused(monkeypatch):
    rollouts = sleepy_rollouts(random.Random(0), 3, 2, 1, monkeypatch)
    try:
        rollouts.take(2)
        with rollouts.paused():
            deadline = time.time() + 60
            while rollouts._flight and time.time() < deadline:  # what was in flight finishes
                time.sleep(0.01)
            assert not rollouts._flight, "what was in flight never finished"
            drawn = rollouts._next_index
            rollouts.push({}, 1)  # the bound moves on: still nothing starts
            time.sleep(0.2)  # (a ticket started meanwhile would show; none on a slow machine proves less, never fails)
            assert rollouts._next_index == drawn and not rollouts._flight
        deadline = time.time() + 60
        while rollouts._next_index == drawn and time.time() < deadline:
            time.sleep(0.01)
        assert rollouts._next_index > drawn
    finally:
        rollouts.close()
        rollouts.join()


# ------------------------------------------------------------------------------- the session
def test_an_async_session_trains_within_the_bound_and_reports_it():
    with rl.Session(**SMALL, seed=0, lr=1e-3, rollout_mode="async", max_staleness=2) as s:
        assert s.algorithm.correction == rl.algorithms.get_correction("token_tis")  # on by default
        s.run(5, progress=False)
        metrics = s.metrics
        evaluation = s.evaluate(max_prompts=8)
    assert (metrics["staleness_max"] <= 2).all() and metrics["staleness_max"].iloc[-1] >= 1
    for name in ("staleness_mean", "staleness_0", "staleness_2", "sampler_kl", "correction/outside_frac",
                 "buffer_groups", "in_flight_groups", "trainer_wait_s", "sampler_wait_s", "restarts"):
        assert name in metrics, name
    assert set(evaluation) == {"greedy_accuracy", "greedy_reward", "sampled_accuracy", "sampled_reward"}


def test_correction_can_be_named_or_turned_off():
    with rl.Session(**SMALL, rollout_mode="async", correction=None) as s:
        assert s.algorithm.correction is None
        s.step()
        s.step()
        batch = s.last_batch  # no correction: PPO's ratio against the weights that sampled
        assert torch.equal(batch["old_logp"], batch["sampler_logp"])
        assert s.metrics["sampler_kl"].iloc[-1] > 0  # the mismatch, from the update's own forward
    with rl.Session(**SMALL, correction="icepop") as s:  # any mode
        assert s.algorithm.correction == rl.algorithms.get_correction("icepop")


@pytest.mark.parametrize("changes, message", [
    (dict(task="calculator", model="tiny-tools"), "rollout_mode='async' samples single completions"),
    (dict(algorithm="remax"), "rollout_mode='async' does not sample algorithm 'remax''s greedy baseline"),
])
def test_what_async_mode_does_not_run_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        rl.Session(**SMALL | changes, rollout_mode="async")


def test_a_resumed_async_run_trains_on_the_same_groups(tmp_path):
    """The checkpoint keeps the finished groups (trained as they were) and the prompts in flight (drawn again)."""
    settings = SMALL | dict(seed=3, lr=1e-3, rollout_mode="async", max_staleness=2)

    def trained(session, steps):
        out = []
        for _ in range(steps):
            session.step()
            batch = session.last_batch
            out.append((batch["ticket"].tolist(), batch["prompt"], batch["response_ids"]))
        return out

    with rl.Session(**settings) as s:
        trained(s, 3)
        folder = s.save(tmp_path / "ckpt")
        buffered = set(torch.load(folder / "rollouts.pt", weights_only=True)["done"])
        whole = trained(s, 3)
    with rl.Session.restore(folder) as r:
        assert r.step_count == 3 and r.state.policy_version == 3
        resumed = trained(r, 3)
    assert buffered, "nothing was buffered at the save: the test would show nothing"
    for (tickets, prompts, ids), (tickets2, prompts2, ids2) in zip(whole, resumed):
        assert tickets == tickets2 and prompts == prompts2
        if set(tickets) <= buffered:  # finished before the save: the very same tokens
            assert torch.equal(ids, ids2)
