"""docs/scale.md is what benchmarks/memory.py computes: its table, the figures in its prose, and the measured check
(benchmarks/results/memory.jsonl, from `--check`) with the model within 20% of every measured peak."""

import json
import sys
from pathlib import Path

from floats import approx

import rlbench as rl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory  # noqa: E402

DOC = (ROOT / "docs" / "scale.md").read_text()


def test_the_table_is_the_models():
    assert memory.table() in DOC


def test_parameter_counts_match_the_published_models():
    # Qwen2.5-0.5B's safetensors hold 494,032,768 parameters; DeepSeek-V3: 671B in all, 37B activated per token
    assert memory.parameters(memory.PUBLISHED["Qwen2.5-0.5B"]) == 494_032_768
    v3 = memory.PUBLISHED["DeepSeek-V3 (671B MoE)"]
    assert 670.5e9 <= memory.parameters(v3) <= 671.5e9  # the published count, rounded to the billion
    assert 37e9 <= memory.parameters(v3, active=True) <= 38e9


def gib(model: str, **layout) -> dict[str, float]:
    parts = memory.memory(memory.PUBLISHED[model], tokens=memory.TABLE_TOKENS, logit_chunk=4096, **layout)
    return {name: round(value / memory.GIB, 1) for name, value in parts.items()}


def test_the_prose_figures_are_the_models():
    assert gib("Qwen2.5-0.5B", ranks=8, bf16=True, checkpointing=True)["logits"] == 7.0
    assert "7.0 GiB" in DOC
    seventy = gib("Llama-3.1-70B", ranks=8, bf16=True, checkpointing=True)
    assert round(seventy["weights"] + seventy["adam"] + seventy["grads"]) == 135 and round(seventy["activations"]) == 26
    assert "135 GiB of weights, gradients and moments before any\nactivation (26 GiB)" in DOC
    v3 = memory.memory(memory.PUBLISHED["DeepSeek-V3 (671B MoE)"], ranks=64, tokens=memory.TABLE_TOKENS, bf16=True,
                       checkpointing=True, logit_chunk=4096)
    sharded = 16 * memory.parameters(memory.PUBLISHED["DeepSeek-V3 (671B MoE)"]) / 64
    gathered = v3["weights"] + v3["adam"] + v3["grads"] - sharded
    assert round(sharded / memory.GIB) == 156 and round(gathered / memory.GIB) == 41
    assert "156 GiB of sharded states, and each gathered MoE layer is 41 GiB" in DOC
    activations = memory.memory(memory.PUBLISHED["Qwen2.5-32B"], ranks=8, tokens=memory.TABLE_TOKENS, bf16=True,
                                logit_chunk=4096)["activations"]
    assert round(activations / memory.GIB) == 301 and "301 GiB of activations" in DOC


def test_the_model_is_within_20_percent_of_the_measured_peaks():
    *rows, summary = [json.loads(line) for line in (ROOT / "benchmarks/results/memory.jsonl").read_text().splitlines()]
    assert len({row["size"] for row in rows}) >= 3 and summary["max_abs_error"] <= 0.2
    assert {row["layout"] for row in rows} == set(memory.CHECK_LAYOUTS)  # one rank, FSDP2 and tensor parallel
    for row in rows:
        assert row["error"] == approx(row["predicted_mb"] / row["measured_mb"] - 1, abs=1e-3)
        assert row["glibc_default_error"] == approx(row["predicted_mb"] / row["glibc_default_mb"] - 1, abs=1e-3)
        line = (f"| {row['size']} | {row['layout']} | {row['parameters']:,} | {row['predicted_mb']:,.1f} MB | "
                f"{row['measured_mb']:,.1f} MB | {100 * row['error']:+.1f}% | {row['glibc_default_mb']:,.1f} MB | "
                f"{100 * row['glibc_default_error']:+.1f}% |")
        assert line in DOC, line
    # the model the rows were measured against is today's
    for row in rows:
        kw = memory.CHECK_SIZES[row["size"]]
        shape = memory.Shape(hidden=kw["hidden"], layers=kw["layers"], intermediate=kw["intermediate"],
                             heads=kw["heads"], kv_heads=kw["kv_heads"], vocab=len(rl.models.build_tokenizer()), tied=True,
                             qkv_bias=True)
        ranks, tensor_parallel = memory.CHECK_LAYOUTS[row["layout"]]
        assert memory.parameters(shape) == row["parameters"]
        predicted = memory.memory(shape, tokens=row["tokens"], ranks=ranks, tensor_parallel=tensor_parallel)
        assert round(predicted["total"] / 2**20, 1) == row["predicted_mb"]


def test_tensor_parallel_by_hand():
    # hidden 4, 2 heads of 2, MLP 8, 10 tied embeddings: attention 4*2*(2*2+2*2) = 64 + norms 8; MLP 3*4*8 = 96;
    # embeddings 40; final norm 4: 212 parameters, of which tensor parallel splits 64 + 96 = 160
    s = memory.Shape(hidden=4, layers=1, intermediate=8, heads=2, kv_heads=2, vocab=10, tied=True)
    assert memory.parameters(s) == 212 and memory.split_parameters(s) == 160
    # 4 ranks, TP 2: 160 / 4 split + 52 / 2 whole-in-a-group per rank = 66; one gathered layer (212 - 40) / 2 = 86
    parts = memory.memory(s, ranks=4, tensor_parallel=2, tokens=1)
    assert parts["weights"] == 4 * 66 + 4 * 86 and parts["adam"] == 8 * 66 and parts["grads"] == 4 * 66
    # per token: 4 * hidden whole, (4 * 8 MLP + 4 * hidden + 2 * 4 KV + 2 heads) / 2 split, + 3 * hidden after the layer
    assert parts["activations"] == 4 * (16 + (32 + 16 + 8 + 2) / 2 + 12)
    assert memory.splits(s, 2) and not memory.splits(s, 4)  # 2 heads do not split 4 ways
    assert not memory.splits(memory.PUBLISHED["DeepSeek-V3 (671B MoE)"], 2)


def test_the_tensor_parallel_prose_is_the_models():
    def part(model, **layout):
        return {k: v / memory.GIB for k, v in memory.memory(memory.PUBLISHED[model], tokens=memory.TABLE_TOKENS,
                                                            logit_chunk=4096, bf16=True, **layout).items()}
    plain, tp2, tp8 = (part("Qwen2.5-32B", ranks=8, tensor_parallel=t) for t in (1, 2, 8))
    assert [round(p["activations"]) for p in (plain, tp2, tp8)] == [301, 171, 73]
    states = [round(p["weights"] + p["adam"] + p["grads"], 1) for p in (plain, tp2)]
    assert states == [62.8, 64.8]
    assert ("301 GiB of activations per rank; split 2 ways they are 171 GiB, 8 ways 73 GiB" in " ".join(DOC.split())
            and "grow from 62.8 to 64.8 GiB at TP 2" in " ".join(DOC.split()))
    seventy = [round(part("Llama-3.1-70B", ranks=64, checkpointing=True, tensor_parallel=t)["total"], 1) for t in (1, 8)]
    assert seventy == [51.1, 47.7] and "from 51.1 to 47.7 GiB" in " ".join(DOC.split())
