"""Sessions on Ray: FSDP2 over 2 ranks matches inline; weight-sync checks; extra workers (reference, critic, teacher,
rollout workers); no processes left behind. Real Ray (a private local instance), real gloo. Faults and joining a
cluster by address: `test_ray_faults.py`."""

import os
import time

import pytest
import torch
from floats import assert_close

import rlbench as rl
from rlbench.workers.cluster import Ray, acquire_ray, release_ray

pytestmark = pytest.mark.slow

CONFIG = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=16, samples_per_prompt=8,
              max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)


@pytest.fixture(scope="module", autouse=True)
def ray_instance(tiny_dir):
    """One private Ray instance for the module (sessions reuse it instead of starting their own)."""
    acquire_ray(Ray(), cpus_needed=8)
    yield
    release_ray()


def test_two_ranks_match_inline_and_close_leaves_nothing(tiny_dir):
    with rl.Session(**CONFIG, cluster="inline", threads=1) as inline:
        expected = inline.run(3, progress=False)
        expected_weights = inline.policy.state_dict()
    session = rl.Session(**CONFIG, cluster="ray", world_size=2)
    metrics = session.run(3, progress=False)
    weights = session.policy.workers.call("policy", rl.policy.Policy.state_dict)
    assert weights[1] is None  # the full weights are gathered on rank 0 only
    for column in ["loss", "pg_loss", "kl_loss", "reward_mean", "grad_norm", "entropy"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order
    for name, value in expected_weights.items():
        assert_close(weights[0][name], value, atol=1e-4, msg=name)  # 1e-4: 2 ranks reduce in another order
    assert metrics["sampler_mismatch_max"].max() < 1e-4 and metrics["time_sync"].gt(0).all()

    pids = [pid for group in session.workers.groups for pid in group.pids()]
    assert len(set(pids)) == 4  # two policy ranks, the sampler, the reward scorer
    import ray

    hosts = [host for group in session.workers.groups for host in group.hosts]
    policies = ray.get([host.__ray_call__.remote(lambda host: os.environ.get("OMP_WAIT_POLICY")) for host in hosts])
    assert policies == ["PASSIVE"] * 4  # inherited from the private instance (conftest sets it), no runtime_env
    session.close()
    session.close()  # idempotent
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.time() < deadline:
        time.sleep(0.5)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "worker processes outlived close()"


def test_workers_get_their_environment_from_a_runtime_env_only_when_they_do_not_inherit_it(monkeypatch):
    from rlbench.workers import cluster

    monkeypatch.setitem(cluster._OWNED, "environ", os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    assert cluster.worker_runtime_env() is None  # a private instance started with it
    monkeypatch.setitem(cluster._OWNED, "environ", {})
    assert cluster.worker_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    monkeypatch.setitem(cluster._OWNED, "environ", None)  # a cluster joined by address: its environment is unknown
    assert cluster.worker_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


def test_skipped_sync_shows_in_the_mismatch_metric(tiny_dir):
    with rl.Session(**CONFIG, cluster="ray") as s:
        s.step()
        assert s.metrics["sampler_mismatch_max"].iloc[-1] < 1e-4
        batch = s.advantage(s.score(s.rollout()))
        s.update(batch, sync=False)  # the policy moved, the sampler did not
        stale = s.advantage(s.score(s.rollout()))
        delta = ((stale["sampler_logp"] - stale["old_logp"]).abs() * stale["response_mask"]).max()
        assert delta > 1e-3
        s.sync_weights()
        fresh = s.advantage(s.score(s.rollout()))
        assert ((fresh["sampler_logp"] - fresh["old_logp"]).abs() * fresh["response_mask"]).max() < 1e-4


def test_overlapped_rollouts_on_ray_match_inline(tiny_dir):
    runs = []
    for cluster in ("inline", "ray"):
        with rl.Session(**CONFIG, cluster=cluster, threads=1, overlap_rollout=True) as s:
            runs.append(s.run(3, progress=False))
    inline, ray = runs
    for column in ["loss", "reward_mean", "grad_norm", "clip_frac", "tokens_generated"]:
        assert_close(torch.tensor(ray[column].values), torch.tensor(inline[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order


@pytest.mark.parametrize("algorithm, placement", [("ppo", "separate"), ("ppo", "colocated"),
                                                  ("reinforce_pp", "separate")])
def test_critic_and_reference_workers(tiny_dir, algorithm, placement):
    small = CONFIG | dict(algorithm=algorithm, prompts_per_step=4, samples_per_prompt=4)
    with rl.Session(**small, cluster="ray", world_size=2, placement=placement) as s:
        names = [g.name for g in s.workers.groups]
        extra = {"ppo": "critic", "reinforce_pp": "reference"}[algorithm]
        assert (extra in names) == (placement == "separate")
        metrics = s.run(2, progress=False)
        assert metrics[["loss", "grad_norm"]].notna().all().all()
        if algorithm == "ppo":
            assert metrics["vf_loss"].gt(0).all()


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_a_teacher_on_two_ranks_matches_inline(tiny_dir, placement):
    # on-policy distillation: the teacher (tiny-arith) scores the student's (tiny-arith-small's) samples, with
    # its top-k for the forward-KL term, in a group of its own or in the policy's rank processes
    algorithm = rl.algorithms.get("grpo_opd").replace(forward_kl_coef=0.5, teacher_topk=4)
    small = CONFIG | dict(model="tiny-arith-small", algorithm=algorithm, teacher=tiny_dir, prompts_per_step=4,
                          samples_per_prompt=4)
    with rl.Session(**small, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
    with rl.Session(**small, cluster="ray", world_size=2, placement=placement) as s:
        assert ("teacher" in [g.name for g in s.workers.groups]) == (placement == "separate")
        metrics = s.run(2, progress=False)
    for column in ["teacher_kl", "forward_kl", "loss", "grad_norm"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order


def test_dynamic_sampling_that_keeps_one_group_still_updates_on_two_ranks(tiny_dir):
    """DAPO, world_size=2, mini_batches_per_step=8, and one kept group of 4 rows: 2 mini-batches of a row per
    rank, not 'cannot split 1 rows across 2 ranks' mid-run."""
    algorithm = rl.algorithms.get("dapo").replace(max_filter_rounds=0)
    small = CONFIG | dict(algorithm=algorithm, prompts_per_step=4, samples_per_prompt=4, mini_batches_per_step=8)
    with rl.Session(**small, cluster="ray", world_size=2) as s:
        batch = s.advantage(s.score(s.rollout()))
        stats = s.update(batch[batch["group_ids"] == batch["group_ids"][0]])
        assert stats["skipped"] == 0 and stats["grad_norm"] >= 0


def test_async_rollout_workers_on_ray_train_every_group_once_within_the_bound(tiny_dir):
    small = CONFIG | dict(prompts_per_step=4, samples_per_prompt=4, lr=1e-3)
    with rl.Session(**small, cluster="ray", rollout_mode="async", max_staleness=1, rollout_workers=2) as s:
        assert [g.name for g in s.workers.groups] == ["policy", "rollout-0", "rollout-1", "rewards"]
        tickets = []
        for _ in range(5):
            s.step()
            tickets += s.last_batch["ticket"][::4].tolist()
        metrics = s.metrics
    assert tickets == list(range(20))  # in order, none lost, none twice
    assert (metrics["staleness_max"] <= 1).all() and metrics["staleness_max"].max() == 1


def test_lora_with_activation_checkpointing_on_two_ranks_matches_inline(tiny_dir, tmp_path):
    """FSDP2 shards the base and the adapter; only the adapter is gathered for the sampler and kept in checkpoints
    (which a different world size loads); the reference is the policy with its adapter off on both ranks."""
    lora = dict(CONFIG, lr=1e-3, lora=rl.LoRA(rank=8, alpha=16), activation_checkpointing=True)
    with rl.Session(**lora, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
        expected_adapter = inline.policy.state_dict()
    with rl.Session(**lora, cluster="ray", world_size=2) as s:
        metrics = s.run(2, progress=False)
        adapter = s.policy.state_dict()
        assert [g.name for g in s.workers.groups if g.name == "reference"] == []
        folder = s.save(tmp_path)
    assert adapter.keys() == expected_adapter.keys() and all("lora_" in name for name in adapter)
    for column in ["loss", "kl_loss", "reward_mean", "grad_norm"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order
    for name, value in expected_adapter.items():
        assert_close(adapter[name], value, atol=1e-4, msg=name)  # 1e-4: 2 ranks reduce in another order
    assert metrics["sampler_mismatch_max"].max() < 1e-4
    with rl.Session.restore(folder, cluster="inline", world_size=1, threads=1) as restored:
        for name, value in restored.policy.state_dict().items():
            assert torch.equal(value, adapter[name]), name
