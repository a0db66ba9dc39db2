"""Sessions on a Ray cluster of several nodes, simulated on this machine (`ray.cluster_utils.Cluster`: a raylet per
node, each with its own CPUs and custom resources; real Ray, real gloo between nodes): where `rl.Ray(nodes=...)`
puts each worker process, read back from the process itself; the numbers of one process; a node lost mid-run."""

import pytest
import torch
from floats import assert_close

import rlbench as rl
from rlbench.runs.sinks import read_jsonl
from rlbench.workers.cluster import _OWNED

pytestmark = pytest.mark.slow

CONFIG = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=4, samples_per_prompt=4,
              max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)
NODE = dict(num_cpus=2, object_store_memory=80 * 2**20, node_ip_address="127.0.0.1")  # loopback only


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    """A head node and two more, 2 CPUs each: the head has the custom resource "head", the others "trainer", and the
    last one "gen" too. The driver connects when a session starts (`rl.Ray(address=...)`)."""
    import ray
    from ray.cluster_utils import Cluster

    assert not _OWNED["sessions"], "a session of another test still holds Ray"
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args=NODE | dict(resources={"head": 1}, include_dashboard=False))
    trainer = nodes.add_node(**NODE, resources={"trainer": 1})
    trainer_gen = nodes.add_node(**NODE, resources={"trainer": 1, "gen": 1})
    nodes.wait_for_nodes()
    nodes.by_resource = {"head": {nodes.head_node.node_id}, "trainer": {trainer.node_id, trainer_gen.node_id},
                         "gen": {trainer_gen.node_id}}
    yield nodes
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()  # the raylets this fixture started, and their workers


def where(session) -> dict[str, list[str]]:
    """Each worker group's processes' node ids, asked of the processes themselves."""
    return {group.name: group.node_ids() for group in session.workers.groups}


def test_spread_puts_the_ranks_on_different_nodes_with_the_numbers_of_one_process(cluster):
    head = cluster.head_node.node_id
    with rl.Session(**CONFIG, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
    with rl.Session(**CONFIG, cluster=rl.Ray(address=cluster.address, nodes="spread"), world_size=2) as s:
        placed = where(s)
        metrics = s.run(2, progress=False)
    assert list(placed) == ["policy", "sampler", "rewards"]
    assert len(set(placed["policy"])) == 2  # the two FSDP ranks talk gloo across nodes
    assert {node for nodes in placed.values() for node in nodes} == {head} | {n.node_id for n in cluster.worker_nodes}
    for column in ["loss", "pg_loss", "kl_loss", "reward_mean", "grad_norm", "entropy"]:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: 2 ranks reduce in another order


def test_roles_go_to_the_nodes_with_their_resources_and_pack_fills_nodes(cluster):
    by_resource = cluster.by_resource
    roles = dict(policy="trainer", sampler="gen", rewards="head")
    with rl.Session(**CONFIG, cluster=rl.Ray(address=cluster.address, nodes=roles), world_size=2) as s:
        placed = where(s)
    assert set(placed["policy"]) <= by_resource["trainer"]
    assert placed["sampler"] == list(by_resource["gen"]) and placed["rewards"] == list(by_resource["head"])
    # four processes of one CPU on nodes of two: two nodes, full
    with rl.Session(**CONFIG, cluster=rl.Ray(address=cluster.address, nodes="pack"), world_size=2) as s:
        nodes = [node for group in where(s).values() for node in group]
    assert len(set(nodes)) == 2 and all(nodes.count(node) == 2 for node in nodes)
    with pytest.raises(ValueError, match=r"no node of the cluster has 'tpu' \(for sampler\); its custom resources: "
                                         r"'gen', 'head', 'trainer'"):
        rl.Session(**CONFIG, cluster=rl.Ray(address=cluster.address, nodes={"sampler": "tpu"}))
    assert not _OWNED["sessions"]  # the refused session let go of Ray


def test_a_node_lost_mid_run_is_survived_on_the_remaining_nodes_with_nothing_lost(cluster, tmp_path):
    lost = []

    def remove_a_policy_node_once(session, row):
        if row["step"] == 2 and not lost:  # step 3 has finished; the last checkpoint is step 2's
            node_id = next(n for n in session.workers.policy.workers.node_ids() if n != cluster.head_node.node_id)
            lost.append(node_id)
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id))

    s = rl.Session(**CONFIG | dict(log_dir=str(tmp_path), run_name="lost"), cluster=rl.Ray(
        address=cluster.address, nodes="spread"), world_size=2, save_every=2)
    s.callbacks.append(remove_a_policy_node_once)
    with pytest.warns(UserWarning, match=r"worker '.*' rank \d died during .* \(at step 3, stage .*restored "
                                         r".*step-000002 and going on \(0 retries left\)"):
        metrics = s.run(4, progress=False, retries=1)
    placed = [node for nodes in where(s).values() for node in nodes]
    adam_steps = s.policy.workers.call("policy", lambda policy: [
        int(state["step"]) for state in policy.optimizer.adamw.state.values()])
    s.close()
    assert lost and lost[0] not in placed and len(set(placed)) == 2  # on the two nodes left
    assert metrics["step"].tolist() == [0, 1, 2, 3]  # steps ...
    assert {step for rank in adam_steps for step in rank} == {4}  # ... = optimizer steps ...
    assert read_jsonl(tmp_path / "lost" / "metrics.jsonl")["step"].tolist() == [0, 1, 2, 3]  # ... = log lines


def test_a_placement_that_is_no_choice_is_named():
    with pytest.raises(ValueError, match=r"Ray\(nodes='scatter'\) is not one of: 'any', 'spread', 'pack', or "):
        rl.Ray(nodes="scatter")
    with pytest.raises(ValueError, match=r"roles among 'policy', .*'rewards' \(not 'trainer'\)"):
        rl.Ray(nodes={"trainer": "gpu_node"})


def test_inline_workers_are_on_no_node():
    import ray

    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""  # this process's node, or none
    with rl.Session(**CONFIG, cluster="inline", threads=1) as s:
        assert where(s) == {"policy": [here], "sampler": [here], "rewards": [here]}
