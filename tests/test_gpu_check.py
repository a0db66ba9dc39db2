"""benchmarks/gpu/check.py, the prepared check for a bare GPU box, run with --dry-run: every check at toy size on the
CPU, each writing its fields into the one JSON file (the run on an H200: benchmarks/results/gpu/check.json)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from floats import approx

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu/check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_check_passes_and_writes_its_fields(dry_run):
    checks = dry_run["checks"]
    assert list(checks) == ["grpo", "mismatch", "update", "fsdp", "memory", "lora", "quickstart"]
    assert all(check["ok"] for check in checks.values())
    assert dry_run["environment"]["torch"] and dry_run["model"]["parameters"] > 0
    for step in checks["grpo"]["steps"]:
        assert {"rollout", "score", "advantage", "update", "sync", "step"} <= set(step["seconds"])
        assert step["sampler_tokens_per_s"] > 0 and step["trainer_tokens_per_s"] > 0
        assert step["rows"] == 2 * 2 and step["response_tokens"] == 2 * 2 * 8  # random weights: to the limit
    assert len(checks["mismatch"]["per_step"]) == len(checks["grpo"]["steps"])
    assert 0 < checks["mismatch"]["per_step"][0]["sampler_mismatch_mean"] < 0.1  # bf16 sampler against bf16 autocast
    assert checks["update"]["tokens_per_s"] > 0 and checks["update"]["mfu"] >= 0
    assert [(run["tokens_per_row"], run["activation_checkpointing"], run["logit_chunk_tokens"])
            for run in checks["memory"]["runs"]] == [(96, False, 0), (96, False, 16), (128, False, 0), (128, False, 16),
                                                     (96, True, 0), (96, True, 16), (128, True, 0), (128, True, 16)]
    assert checks["lora"]["lora_rank_4"]["trained_parameters"] < checks["lora"]["full"]["trained_parameters"] / 10
    assert set(checks["quickstart"]["cpu"]) == {"greedy_accuracy_before", "greedy_accuracy_after", "seconds_per_step"}


def test_fsdp_over_a_one_rank_mesh_equals_the_unsharded_policy(dry_run):
    fsdp = dry_run["checks"]["fsdp"]
    assert fsdp["dtensor"] == "DTensor" and fsdp["backend"] == "gloo"  # sharded for real, on the N-rank path
    assert fsdp["fsdp"]["loss"] == approx(fsdp["inline"]["loss"])
    assert fsdp["gradient_relative_difference"] < 1e-5 and fsdp["update_relative_difference"] < 1e-5
