"""The performance shortcuts compute exactly what the plain path computes."""

import pytest
import torch
from floats import approx, assert_close, assert_same

import rlbench as rl
from rlbench.batch import Batch, left_pad
from rlbench.policy import Policy, response_outputs
from rlbench.policy.forward import _pack, _prefix_tree
from rlbench.policy.training import OptimSettings
from rlbench.samplers import HFSampler, SamplingParams

SMALL = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
             samples_per_prompt=4, max_new_tokens=8, log_dir=None)


def test_update_without_old_logp_equals_update_with_recomputed_old_logp(tiny_dir, rollout):
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    counts = dict(num_tokens=int(rollout["response_mask"].sum()), num_seqs=len(rollout), norm_length=8)
    recorded, fused = (Policy(tiny_dir, OptimSettings(lr=1e-3), micro_batch_tokens=40) for _ in range(2))
    with_old = recorded.forward_backward(rollout.with_columns(old_logp=recorded.log_probs(rollout)), algorithm, **counts)
    without = fused.forward_backward(rollout, algorithm, **counts)
    recorded.optim_step(), fused.optim_step()
    for (name, a), b in zip(recorded.state_dict().items(), fused.state_dict().values()):
        assert_same(a, b, msg=name)  # bit for bit: the same forward, ratio 1
    assert without["loss"] == with_old["loss"] and without["approx_kl"] == 0.0
    # the sampler's log-probs agree with this forward (what batch_metrics reports on the plain path)
    assert without["sampler_mismatch_max"] < 1e-5 and 0 < without["sampler_mismatch_mean"] < 1e-6


def test_session_on_policy_old_logp_trains_like_the_plain_session(tiny_dir):
    runs = []
    for fused in (False, True):
        with rl.Session(**SMALL, seed=3, on_policy_old_logp=fused) as s:
            metrics = s.run(2, progress=False)
            runs.append((metrics, s.last_batch, s.policy.state_dict()))
    (plain, plain_batch, plain_weights), (fast, fast_batch, fast_weights) = runs
    assert "old_logp" in plain_batch and "old_logp" not in fast_batch
    for name, weight in plain_weights.items():
        assert_close(fast_weights[name], weight, msg=name)
    assert fast["loss"].tolist() == approx(plain["loss"].tolist())
    assert fast["sampler_mismatch_max"].max() < 1e-4


def test_on_policy_old_logp_is_refused_off_policy():
    with pytest.raises(ValueError, match="epochs_per_step=1"):
        rl.config.make_config(on_policy_old_logp=True, epochs_per_step=2)
    with pytest.raises(ValueError, match="reads old_logp"):
        rl.Session(**SMALL | dict(algorithm="reinforce_pp"), on_policy_old_logp=True)


def test_bf16_precision_stays_close_to_fp32(tiny_dir, rollout):
    fp32, bf16 = Policy(tiny_dir, OptimSettings(lr=1e-3)), Policy(tiny_dir, OptimSettings(lr=1e-3), precision="bf16")
    mask = rollout["response_mask"].bool()
    assert fp32.log_probs(rollout).dtype == bf16.log_probs(rollout).dtype == torch.float32
    assert 0 < (fp32.log_probs(rollout) - bf16.log_probs(rollout))[mask].abs().max() < 0.1
    sampler = HFSampler.from_pretrained(tiny_dir, precision="bf16")
    assert sampler.model.dtype == torch.bfloat16
    sampler.load_weights(fp32.state_dict())  # fp32 weights are cast on load
    prompt = rollout["prompt_ids"][0][rollout["prompt_mask"][0].bool()].tolist()
    out = sampler.generate([prompt], SamplingParams(n=4, seed=0))
    assert out["sampler_logp"].dtype == torch.float32 and out["response_mask"].sum() > 0


def padded_forward(model, batch):
    """Each row's own forward (prompt and response, padded): the outputs that predict its response tokens."""
    ids_B_L = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    mask_B_L = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    P, T = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    with torch.no_grad():
        return model(input_ids=ids_B_L, attention_mask=mask_B_L,
                     position_ids=(mask_B_L.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1 : P + T - 1]


def test_shared_prompt_packing_equals_the_padded_forward(tiny, rollout):
    # 4 groups of 4 samples: each prompt runs once, every response token sees its prompt and its own prefix
    model, _ = tiny
    with torch.no_grad():
        packed = response_outputs(model, rollout)
    valid = rollout["response_mask"].bool()
    assert_close(packed[valid], padded_forward(model, rollout)[valid], atol=1e-5)  # 1e-5: packed vs padded attention


def test_shared_response_prefixes_run_once_and_equal_the_padded_forward(tiny):
    model, tokenizer = tiny
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # (prompt, response) rows; "$" is EOS. Group 0's prefixes: 4 46 46$ 47 47$ 5 56 56$ (a row that ends
    # inside another's prefix shares it); group 1's: 1 12 12$; the prompt of group 0 again, not next to
    # it, is a group of its own: 4 46 46$
    rows = [("12+34=", r) for r in ["46$", "46$", "4", "47$", "56$", "4"]] + [("7+5=", "12$"), ("7+5=", "1"),
                                                                             ("12+34=", "46$")]
    prompts = [encode(p) for p, _ in rows]
    responses = [encode(r.rstrip("$")) + [eos] * r.endswith("$") for _, r in rows]
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    T = max(map(len, responses))
    response_ids = torch.tensor([r + [pad] * (T - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    batch = Batch(dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=response_mask))
    group_B = torch.tensor([0] * 6 + [1] * 2 + [2])
    tree = _prefix_tree(group_B, response_ids, response_mask.bool(), 3)
    assert tree.nodes_G.tolist() == [8, 3, 3]  # 14 token slots for the 21 response tokens
    assert tree.node_B_T[0].tolist() == tree.node_B_T[1].tolist()  # identical rows: the same slots
    assert tree.node_B_T[2, 0] == tree.node_B_T[0, 0] == tree.node_B_T[3, 0] != tree.node_B_T[4, 0]
    with torch.no_grad():
        packed = response_outputs(model, batch)
    valid = response_mask.bool()
    assert_close(packed[valid], padded_forward(model, batch)[valid], atol=1e-5)  # 1e-5: packed vs padded attention


def test_the_prefix_tree_is_the_trie_of_each_groups_responses():
    # random groups of short responses over 3 tokens (many shared prefixes, repeats, empty rows), against a trie
    # built by hand: a node per distinct (group, prefix), numbered in depth-first order with children in token order
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        B, T = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        ids = torch.randint(0, 3, (B, T), generator=g)
        mask = torch.arange(T) < torch.randint(0, T + 1, (B, 1), generator=g)
        group = torch.sort(torch.randint(0, 3, (B,), generator=g)).values.unique(return_inverse=True)[1]
        groups = int(group.max()) + 1
        tree = _prefix_tree(group, ids, mask, groups)
        rows = [tuple(ids[b, : int(mask[b].sum())].tolist()) for b in range(B)]
        prefixes = [sorted({r[: t + 1] for b, r in enumerate(rows) if group[b] == k for t in range(len(r))})
                    for k in range(groups)]  # sorted tuples: depth-first, children in token order
        assert tree.nodes_G.tolist() == [len(p) for p in prefixes]
        node_of = {(int(tree.group_M[m]), int(tree.preorder_M[m])): m for m in range(len(tree.token_M))}
        for k, group_prefixes in enumerate(prefixes):
            for preorder, prefix in enumerate(group_prefixes):
                m = node_of[k, preorder]
                assert (int(tree.token_M[m]), int(tree.depth_M[m])) == (prefix[-1], len(prefix) - 1)
                assert int(tree.size_M[m]) == sum(p[: len(prefix)] == prefix for p in group_prefixes)
        for b, r in enumerate(rows):
            expected = [node_of[int(group[b]), prefixes[group[b]].index(r[: t + 1])] for t in range(len(r))]
            assert tree.node_B_T[b].tolist() == expected + [-1] * (T - len(r))


def test_groups_are_packed_longest_first_into_the_fewest_slots():
    # widths 9, 18, 27, ...: 9 takes 3 rows (27 slots: [9] [9] [5 4]), 27 one row of 27: the narrower wins
    assert _pack([5, 9, 4, 9]) == ([18, 0, 23, 9], 3, 9)
    assert _pack([6, 4, 4, 4]) == ([0, 6, 10, 14], 1, 18)  # 6 and 12 take 24 slots, 18 exactly 18


def test_a_response_mask_with_a_gap_is_refused(tiny, rollout):
    model, _ = tiny
    mask = rollout["response_mask"].clone()
    mask[5, 0] = 0
    with pytest.raises(ValueError, match="response_mask of row 5 has a 0 before a 1"):
        response_outputs(model, rollout.with_columns(response_mask=mask))
