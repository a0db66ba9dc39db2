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
    assert len(rows) >= 3 and summary["max_abs_error"] <= 0.2
    for row in rows:
        assert row["error"] == approx(row["predicted_mb"] / row["measured_mb"] - 1, abs=1e-3)
        line = (f"| {row['size']} | {row['parameters']:,} | {row['predicted_mb']:,.1f} MB | {row['measured_mb']:,.1f} MB"
                f" | {100 * row['error']:.1f}% |")
        assert line in DOC, line
    # the model the rows were measured against is today's
    for row in rows:
        kw = memory.CHECK_SIZES[row["size"]]
        shape = memory.Shape(hidden=kw["hidden"], layers=kw["layers"], intermediate=kw["intermediate"],
                             heads=kw["heads"], kv_heads=kw["kv_heads"], vocab=len(rl.models.build_tokenizer()), tied=True,
                             qkv_bias=True)
        assert memory.parameters(shape) == row["parameters"]
        assert round(memory.memory(shape, tokens=row["tokens"])["total"] / 2**20, 1) == row["predicted_mb"]
