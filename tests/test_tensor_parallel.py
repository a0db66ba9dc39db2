"""Tensor parallel inside FSDP2 (`tensor_parallel=2`, world_size=4: a 2 x 2 mesh): the steps and weights of one inline
rank; each block's projections split over the mesh, read back from the ranks; the sampler fed from the split weights;
a checkpoint of the 2 x 2 mesh restored on 4 x 1 and 1 x 1 taking the same next step; what cannot be split, refused
before any worker starts. Real Ray (a private local instance), real gloo, real DTensor."""

import pytest
import torch
from floats import assert_close
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

import rlbench as rl
from rlbench.config import make_config
from rlbench.policy import Policy
from rlbench.policy.training import check_tensor_parallel
from rlbench.workers.cluster import Ray, acquire_ray, release_ray

pytestmark = pytest.mark.slow

CONFIG = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=8, samples_per_prompt=8,
              max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)
COLUMNS = ["loss", "pg_loss", "kl_loss", "reward_mean", "grad_norm", "entropy"]


@pytest.fixture(scope="module", autouse=True)
def ray_instance(tiny_dir):
    """One private Ray instance for the module: six worker processes at most (4 policy ranks, sampler, rewards)."""
    acquire_ray(Ray(), cpus_needed=6)
    yield
    release_ray()


def weights(session) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in session.policy.state_dict().items()}


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """Two steps on a 2 x 2 mesh, saved after the first; and the same two steps on one inline rank."""
    def split(policy: Policy) -> dict[str, tuple]:  # on each rank (a closure: Ray sends it by value)
        """A few parameters' mesh dimensions and their local share of the whole."""
        params = dict(policy.model.named_parameters())
        return {name: (params[name].device_mesh.mesh_dim_names, params[name].to_local().numel() / params[name].numel())
                if isinstance(params[name], DTensor) else None
                for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                             "model.embed_tokens.weight"]}

    with rl.Session(**CONFIG, cluster="inline", threads=1) as inline:
        expected = inline.run(2, progress=False)
        expected_weights = weights(inline)
    with rl.Session(**CONFIG, cluster="ray", world_size=4, tensor_parallel=2) as s:
        first = s.run(1, progress=False)
        path = s.save(tmp_path_factory.mktemp("mesh") / "checkpoints")
        metrics = s.run(1, progress=False)
        per_rank = s.policy.workers.call("policy", Policy.state_dict)
        return dict(expected=expected, expected_weights=expected_weights, first=first, metrics=metrics, path=path,
                    weights=per_rank[0], others=per_rank[1:], split=s.policy.workers.call("policy", split))


def test_a_step_on_a_2x2_mesh_is_one_inline_ranks(mesh_run):
    expected, metrics = mesh_run["expected"], mesh_run["metrics"]
    assert expected["grad_norm"].gt(1.0).all()  # grad_clip=1: both steps clip, over the two meshes' norms together
    for column in COLUMNS:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(expected[column].values),
                     atol=1e-4, msg=column)  # 1e-4: the all-reduces sum in another order
    for name, value in mesh_run["expected_weights"].items():
        assert_close(mesh_run["weights"][name], value, atol=1e-4, msg=name)


def test_each_block_is_split_over_the_tensor_parallel_ranks_and_sharded_over_the_groups(mesh_run):
    for per_rank in mesh_run["split"]:
        # the projections: a quarter on each rank (2 tensor-parallel ways x 2 data-parallel shards)
        assert per_rank["model.layers.0.self_attn.q_proj.weight"] == (("dp", "tp"), 0.25)
        assert per_rank["model.layers.1.mlp.down_proj.weight"] == (("dp", "tp"), 0.25)
        # the embeddings (tied to the head): whole within a tensor-parallel group, FSDP-sharded over the groups
        mesh, share = per_rank["model.embed_tokens.weight"]
        assert mesh == ("dp",) and share in (130 / 259, 129 / 259)  # 259 rows over 2 shards


def test_the_sampler_takes_the_gathered_weights_from_rank_0(mesh_run):
    weights = mesh_run["weights"]
    assert mesh_run["others"] == [None, None, None]  # gathered once, kept by rank 0 alone
    assert {name: tuple(v.shape) for name, v in weights.items()} == \
        {name: tuple(v.shape) for name, v in mesh_run["expected_weights"].items()}  # whole tensors, each name once
    # the sampler sampled the second step with what the first step's sync sent it: its log-probs are the trainer's
    assert mesh_run["metrics"]["sampler_mismatch_max"].max() < 1e-4


@pytest.mark.parametrize("layout", [dict(cluster="ray", world_size=4, tensor_parallel=1),
                                    dict(cluster="inline", world_size=1, tensor_parallel=1)], ids=["4x1", "1x1"])
def test_a_2x2_checkpoint_restores_on_another_mesh_with_the_same_next_step(mesh_run, layout):
    with rl.Session.restore(mesh_run["path"], **layout) as s:
        metrics = s.run(1, progress=False)
        restored = weights(s)
    assert metrics["step"].tolist() == [0, 1]  # the saved step's row, then the new one
    for column in COLUMNS:
        assert_close(torch.tensor(metrics[column].values), torch.tensor(mesh_run["metrics"][column].values),
                     atol=1e-4, msg=column)
    for name, value in mesh_run["weights"].items():  # AdamW's moments came back too: else the step would differ
        assert_close(restored[name], value, atol=1e-4, msg=name)


def test_what_tensor_parallel_cannot_split_is_refused_before_any_worker_starts(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide world_size=4"):
        make_config(**CONFIG, cluster="ray", world_size=4, tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel=2 with lora"):
        make_config(**CONFIG, cluster="ray", world_size=2, tensor_parallel=2, lora=rl.LoRA(rank=4))
    with pytest.raises(ValueError, match="across the 2 data-parallel groups of world_size=4, tensor_parallel=2"):
        make_config(**CONFIG | dict(prompts_per_step=1, samples_per_prompt=1), cluster="ray", world_size=4,
                    tensor_parallel=2)
    # tiny-arith has 6 query heads and 2 key-value heads: 4 ways does not divide them
    with pytest.raises(ValueError, match=r"tensor_parallel=4 does not divide Qwen2ForCausalLM's num_attention_heads=6, "
                                         r"num_key_value_heads=2"):
        rl.Session(**CONFIG, cluster="ray", world_size=4, tensor_parallel=4)
    with pytest.raises(ValueError, match="algorithm 'ppo' trains a critic"):
        rl.Session(**CONFIG | dict(algorithm="ppo"), cluster="ray", world_size=4, tensor_parallel=2)


def test_a_mixture_of_experts_is_not_split_as_a_dense_block():
    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, vocab_size=50)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM's decoder blocks are not dense"):
        check_tensor_parallel(model, 2)


RANK = """
import sys
import torch
import rlbench as rl
from rlbench.batch import Batch
from rlbench.policy import Policy
from rlbench.policy.training import OptimSettings
torch.set_num_threads(1)
model_dir, rank, world, tp, address, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6]
g = torch.Generator().manual_seed(0)
rows, prompt, response = 4, 6, 10
response_mask = (torch.arange(response) < torch.tensor([[10], [7], [3], [9]])).long()
batch = Batch(dict(prompt_ids=torch.randint(3, 250, (rows, prompt), generator=g),
                   prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
                   response_ids=torch.randint(3, 250, (rows, response), generator=g) * response_mask,
                   response_mask=response_mask, advantages=torch.randn(rows, response, generator=g) * response_mask,
                   sampler_logp=torch.zeros(rows, response)))
policy = Policy(model_dir, OptimSettings(lr=1e-3), rank=rank, world_size=world, tensor_parallel=tp,
                init_method=address if world > 1 else None)
logp = policy.log_probs(batch)
terms, step = policy.train_step(batch, rl.algorithms.get("grpo").replace(kl_coef=0.0),
                                num_tokens=int(response_mask.sum()), num_seqs=rows, norm_length=response)
state = policy.state_dict()
if rank == 0:
    torch.save(dict(logp=logp, terms=terms, step=step, state=state), out)
"""


def test_a_llama_split_two_ways_computes_one_ranks_numbers(tmp_path):
    """A random Llama (no q/k/v bias, untied head) on a 1 x 2 mesh, its ranks run as plain processes over gloo: the
    log-probs, one step's loss and gradient norm, and the weights after it, as one unsplit rank computes them."""
    import os
    import socket
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                 max_position_embeddings=64)).save_pretrained(tmp_path / "llama")
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}

    def run(world: int, tp: int) -> dict:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        out = tmp_path / f"{world}x{tp}.pt"
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "llama"), str(rank), str(world), str(tp),
                                   address, str(out)], env=env, stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
        for rank in ranks:
            assert rank.wait(timeout=300) == 0, rank.stderr.read()[-3000:]
        return torch.load(out, weights_only=False)

    alone, split = run(1, 1), run(2, 2)
    assert_close(split["logp"], alone["logp"], msg="log-probs")
    assert alone["step"]["grad_norm"] > 1.0  # grad_clip=1 clips it: the combined norm scales both meshes' gradients
    for name in ["loss", "pg_loss"]:
        assert_close(split["terms"][name], alone["terms"][name], msg=name)
    assert_close(split["step"]["grad_norm"], alone["step"]["grad_norm"], msg="grad_norm")
    assert split["state"].keys() == alone["state"].keys()
    for name, value in alone["state"].items():
        assert_close(split["state"][name], value, atol=1e-5, msg=name)  # 1e-5: after an lr-1e-3 step
