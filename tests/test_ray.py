"""Sessions on Ray: FSDP2 over 2 ranks matches inline; joining a cluster by address; weight-sync checks;
extra workers; no processes left behind. Real Ray (a private local instance), real gloo."""

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from floats import assert_close, assert_same

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


def test_image_prompts_on_two_ranks_match_inline():
    """tiny-vl on the shapes task: each rank gets its rows' pixels (`image_inputs`) and FSDP2 shards the vision tower
    with the language model; the steps equal one inline rank's."""
    vl = dict(model="tiny-vl", task=rl.tasks.Shapes(), prompts_per_step=4, samples_per_prompt=4, seed=0, log_dir=None)
    with rl.Session(**vl, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
    with rl.Session(**vl, cluster="ray", world_size=2) as ray:
        metrics = ray.run(2, progress=False)
    for column in ["loss", "kl_loss", "reward_mean", "grad_norm", "entropy", "sampler_kl"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order
    assert metrics["sampler_mismatch_max"].max() < 1e-4


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


def test_two_ranks_with_a_chunked_head_match_the_whole_head_inline(tiny_dir):
    # the chunked head inside FSDP2's forward (its weights gathered there, its gradient reduced with the rest), for
    # the policy and the reference (GRPO's KL term), against one rank with the whole logits
    small = CONFIG | dict(prompts_per_step=4, samples_per_prompt=4)
    with rl.Session(**small, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
    with rl.Session(**small, cluster="ray", world_size=2, logit_chunk_tokens=7) as chunked:
        metrics = chunked.run(2, progress=False)
    for column in ["loss", "kl_loss", "grad_norm", "entropy", "sampler_mismatch_max"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
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


JOIN = """
import json, sys, rlbench as rl
with rl.Session(model="tiny-arith", cluster=rl.Ray(address=sys.argv[1]), prompts_per_step=4, samples_per_prompt=4,
                max_new_tokens=8, log_dir=None) as s:
    row = s.step()
print(json.dumps({"reward_mean": row["reward_mean"], "loss": row["loss"]}))
"""


def test_join_a_cluster_by_address(tiny_dir):
    # loopback only (Ray otherwise maps 127.0.0.1 to the machine's address), with its own token
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    port = 6400 + os.getpid() % 500
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="rlray", dir="/tmp")  # short: Ray's socket paths have a length limit
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--temp-dir={temp_dir}", "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run([sys.executable, "-c", JOIN, f"127.0.0.1:{port}"], env=env, capture_output=True,
                             text=True, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        row = json.loads(out.stdout.strip().splitlines()[-1])
        assert 0.0 <= row["reward_mean"] <= 1.0
    finally:
        os.killpg(head.pid, 15)  # only the processes this test started
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_killed_rank_is_restored_from_the_last_checkpoint_and_without_retries_it_is_named(tiny_dir, tmp_path):
    import ray

    small = CONFIG | dict(prompts_per_step=4, samples_per_prompt=4)
    with rl.Session(**small, cluster="ray", world_size=2) as whole:
        expected = whole.run(4, progress=False)
        expected_weights = whole.policy.state_dict()

    killed = []

    def kill_rank_1_once(session, row):
        if row["step"] == 2 and not killed:  # step 3 has finished; the last checkpoint is step 2's
            killed.append(session.policy.workers.pids()[1])
            ray.kill(session.policy.workers.hosts[1], no_restart=True)

    s = rl.Session(**small, cluster="ray", world_size=2, save_every=2, save_dir=str(tmp_path))
    s.callbacks.append(kill_rank_1_once)
    with pytest.warns(UserWarning, match=r"worker 'policy' rank 1 died during .* \(at step 3, stage .*restored "
                                         r".*step-000002 and going on \(0 retries left\)"):
        metrics = s.run(4, progress=False, retries=1)
    assert killed and killed[0] not in s.policy.workers.pids()  # the workers were started afresh
    assert metrics["step"].tolist() == [0, 1, 2, 3]
    for column in ["loss", "reward_mean", "grad_norm", "entropy", "kl_loss"]:  # the restart changed nothing
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-5, msg=column)  # 1e-5: a restart, the same 2 ranks
    weights = s.policy.state_dict()

    # with no retries left (a step outside run(retries=...)), the dead worker is named and the work done stays
    ray.kill(s.policy.workers.hosts[1], no_restart=True)
    with pytest.raises(rl.workers.cluster.WorkerDied, match=r"worker 'policy' rank 1 died during .* \(at step 4, stage"):
        s.step()
    assert len(s.metrics) == 4
    s.close()
    for name, value in expected_weights.items():
        assert_close(weights[name], value, atol=1e-5, msg=name)  # 1e-5: a restart, the same 2 ranks

    # the two-rank checkpoint loads into one inline rank (torch.distributed.checkpoint reshards it)
    with rl.Session.restore(tmp_path, cluster="inline", world_size=1, threads=1) as inline:
        assert inline.step_count == 4
        for name, value in inline.policy.state_dict().items():
            assert_same(value, weights[name], msg=name)  # bit for bit: a checkpoint round trip, resharded


def test_a_world_size_the_cluster_cannot_hold_is_named(tiny_dir):
    import ray

    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(ValueError, match=rf"world_size=16 \(placement='colocated': 18 worker processes at "
                                         rf"cpus_per_worker=1\) needs 18 CPUs but the Ray cluster has {cpus:g}"):
        rl.Session(**CONFIG, cluster="ray", world_size=16)


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


def test_a_rollout_worker_killed_mid_generation_is_replaced_and_no_group_is_lost(tiny_dir):
    """Its process is killed by its id while it samples: a new worker takes its place with the newest weights, its
    groups are sampled again under their own tickets, and training goes on in ticket order."""
    small = CONFIG | dict(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=12, temperature=1.5)
    with rl.Session(**small, cluster="ray", rollout_mode="async", max_staleness=1) as s:
        tickets, killed = [], None
        for step in range(5):
            s.step()
            tickets += s.last_batch["ticket"][::8].tolist()
            if step == 1:  # the push after this update lets the worker start the next tickets: catch it sampling
                deadline = time.time() + 10
                while not s.source.rollouts._flight and time.time() < deadline:
                    time.sleep(0.001)
                assert s.source.rollouts._flight, "the worker never started a rollout"
                killed = s.workers.rollout[0].workers.pids()[0]
                os.kill(killed, 9)
        metrics = s.metrics
        new = s.workers.rollout[0].workers.pids()[0]
    assert new != killed and metrics["restarts"].sum() == 1
    assert tickets == list(range(40))
    assert (metrics["staleness_max"] <= 1).all()


def test_a_call_while_a_killed_rollout_worker_is_replaced_waits_and_runs_on_the_new_one(tiny_dir):
    """`s.sampler` is rollout worker 0's handle. Its worker is killed while it samples; while its feeder starts a new
    one (the dead one's group already ended), `s.evaluate()` waits for it and runs on it, with the newest weights,
    instead of failing as if the session were closed. A closed session's handle still refuses at once."""
    small = CONFIG | dict(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=12, temperature=1.5)
    with rl.Session(**small, cluster="ray", rollout=rl.Async(max_staleness=1, workers=2)) as s:
        s.step()  # its push lets the workers start the next tickets: catch worker 0 sampling
        deadline = time.time() + 10
        while not s.source.rollouts._flight.get(0) and time.time() < deadline:
            time.sleep(0.001)
        dead = s.sampler.workers
        killed = dead.pids()[0]
        os.kill(killed, 9)
        while dead.hosts and time.time() < deadline:  # the replacement has begun: the dead worker's group is ended
            time.sleep(0.001)
        assert not dead.hosts, "the feeder never replaced the killed worker"
        result = s.evaluate(max_prompts=4)
        assert set(result) == {"greedy_accuracy", "greedy_reward", "sampled_accuracy", "sampled_reward"}
        assert s.sampler.workers.pids()[0] != killed
        assert s.sampler.workers.call("sampler", lambda rollouts: rollouts.version) == [s.state.policy_version]
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"the 'rollout-0' workers are closed \(the session was closed\)"):
        s.evaluate(max_prompts=4)
    assert time.perf_counter() - start < 5  # at once, without waiting for a new worker (a generous bound for a busy machine)


def test_calls_waiting_for_a_new_rollout_worker_that_cannot_start_fail_with_its_reason():
    """An inline worker whose sampler raises WorkerDied stands for a dead one; its replacement fails. The call that
    found it dead gets the replacement's error; a call that waited for the replacement, and any later call, fail
    with it as the reason, and none waits forever."""
    import threading

    from rlbench.workers import SamplerHandle
    from rlbench.workers.cluster import WorkerDied, WorkerGroup

    class Dead:
        def generate(self, prompt_ids, params):
            raise WorkerDied("worker 'rollout-0' rank 0 died during generate: killed")

    group = WorkerGroup("rollout-0", 1, ray=False, threads=None)
    group.build("sampler", Dead, [{}])
    started, release = threading.Event(), threading.Event()

    def restart(dead):
        started.set()
        release.wait(10)
        raise ValueError("no CPU left for a new worker")

    class Watched(threading.Condition):
        """The handle's lock, which says when a thread waits on it for the new worker."""

        def __init__(self):
            super().__init__()
            self.waiting = threading.Event()

        def wait_for(self, predicate, timeout=None):
            if not predicate():
                self.waiting.set()
            return super().wait_for(predicate, timeout)

    handle = SamplerHandle(group, None, "Dead", "a test's dead sampler", restart=restart)
    handle._swap = Watched()
    params = rl.samplers.SamplingParams(n=1, max_new_tokens=2)
    errors = {}

    def call(name, fn):
        try:
            fn()
        except BaseException as error:
            errors[name] = error

    finder = threading.Thread(target=call, args=("finder", lambda: handle.generate_ids([[1, 2]], params)))
    finder.start()
    assert started.wait(10)
    waiter = threading.Thread(target=call, args=("waiter", handle.state_dict))
    waiter.start()
    assert handle._swap.waiting.wait(10), "the waiter did not wait for the new worker"
    release.set()
    for thread in (finder, waiter):
        thread.join(10)
        assert not thread.is_alive()
    assert isinstance(errors["finder"], ValueError)
    for error in (errors["waiter"], pytest.raises(RuntimeError, handle.generate_ids, [[1]], params).value):
        assert isinstance(error, RuntimeError) and str(error) == ("the 'rollout-0' worker died and no new one could be "
                                                                  "started: no CPU left for a new worker")


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
