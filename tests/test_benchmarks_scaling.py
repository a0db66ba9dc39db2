"""The cost-curve benchmark and its GPU check run end to end at toy sizes (as subprocesses, the way they are run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from floats import approx

REPO = Path(__file__).resolve().parents[1]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # ~80 s: two model sizes, full and LoRA, each in its own process
def test_scaling_quick_writes_rows_fit_and_plot(tmp_path):
    out, png = tmp_path / "scaling.jsonl", tmp_path / "scaling.png"
    run = subprocess.run([sys.executable, "scaling.py", "--quick", "--lora", "--out", str(out), "--plot", str(png)],
                         cwd=REPO / "benchmarks", env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = json_lines(run.stdout)
    rows, summary = lines[:-1], lines[-1]
    assert [(r["model"], r["variant"]) for r in rows] == [("random-qwen2-~1M", "full"), ("random-qwen2-~1M", "lora"),
                                                         ("random-qwen2-~4M", "full"), ("random-qwen2-~4M", "lora")]
    for row in rows:
        assert row["sweep"] == "model_size" and row["steps"] == 1 and row["parameters"] > 1e6
        if row["variant"] == "full":
            assert row["trainable_parameters"] == row["parameters"]
        else:  # the adapter alone: rank 16 on every linear layer of a block, a few percent of the model
            assert 0 < row["trainable_parameters"] < row["parameters"] / 5
        assert row["s_per_step"] > 0 and row["stages_s"]["rollout"] > 0 and row["stages_s"]["update"] > 0
        assert row["generated_tokens_per_s"] > 0 and row["trained_tokens_per_s"] > 0
        assert row["peak_rss_mb"] > row["model_mb"] > 0
    assert rows[2]["parameters"] > 3 * rows[0]["parameters"]
    assert rows[1]["parameters"] == rows[0]["parameters"] + rows[1]["trainable_parameters"]  # the base and the adapter
    for fit in (summary["fit"]["full"], summary["fit"]["lora"]):
        assert summary["summary"] and fit["sizes"] == 2
        assert {"s_per_step_exponent", "peak_rss_mb_exponent", "model_mb_exponent"} <= set(fit)
    assert json_lines(out.read_text()) == lines  # the saved file holds what was printed
    assert png.stat().st_size > 10_000

    # --plot-only refits and redraws the saved lines without running anything
    png.unlink()
    again = subprocess.run([sys.executable, "scaling.py", "--plot-only", str(out), "--plot", str(png)],
                           cwd=REPO / "benchmarks", env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json_lines(again.stdout) == [summary] and png.exists()


SCALING_CHECK = str(REPO / "benchmarks/gpu/scaling_check.py")


def test_gpu_scaling_check_smoke():  # ~10 s (~30 s on a busy machine): two toy models built, sampled and trained
    smoke = subprocess.run([sys.executable, SCALING_CHECK, "--smoke"], env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    measured_1, measured_2, estimate = json_lines(smoke.stdout)
    assert [measured_1["layers"], measured_2["layers"]] == [1, 2]
    for m in (measured_1, measured_2):
        assert m["rollout"]["decode_tokens_per_s"] > 0 and m["rollout"]["response_tokens_mean"] == 5
        for checkpointing in (False, True):
            update = m[f"update_checkpointing_{checkpointing}"]
            assert update["activation_checkpointing"] is checkpointing and update["train_tokens_per_s"] > 0
            assert update["tokens"] == 4 * (6 + 5)
    # extrapolated to the shape's 2 layers through the measured 1 and 2: the 2-layer numbers again (2e-3 s: the
    # timings are rounded to 1 ms, extrapolated and rounded again)
    assert estimate["measured"]["layers"] == 2 and estimate["measured"]["extrapolated_from_layers"] == [1, 2]
    assert estimate["measured"]["update_checkpointing_True"]["forward_backward_s"] == approx(
        measured_2["update_checkpointing_True"]["forward_backward_s"], abs=2e-3)
    assert set(estimate["step"]) == {"rollout_s", "update_s", "step_s"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check runs instead of skipping")
def test_gpu_scaling_check_skips_without_cuda():
    skip = subprocess.run([sys.executable, SCALING_CHECK], env=ENV, capture_output=True, text=True, timeout=120)
    assert skip.returncode == 0 and "skipped" in json_lines(skip.stdout)[0]
