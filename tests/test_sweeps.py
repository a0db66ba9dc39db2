"""rl.sweep: runs as Ray tasks into one table, a second call skips finished runs and resumes an interrupted one from
its checkpoint, a failing run is recorded while the others finish; the statistics on hand-worked tables; the
`rlbench sweep` command and the leaderboard page from hand-made rows."""

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from floats import approx

import rlbench as rl
from rlbench import cli
from rlbench.experiments import recipes, stats, sweeps
from rlbench.workers.cluster import acquire_ray, release_ray

SETTINGS = {"model": "tiny-arith", "task": "arithmetic", "prompts_per_step": 4, "samples_per_prompt": 4,
            "max_new_tokens": 8, "threads": 1}
GRID = {"model": ["tiny-arith", "/nonexistent/model"]}
"""Two points: the tiny model, and a model folder that is not there (the run fails when it builds its session)."""


def starts(folder) -> list[dict]:
    """The "start" events a run's own process wrote into its log: one per attempt."""
    return [e for e in sweeps.RunLog(folder).events() if e["event"] == "start"]


@pytest.fixture(scope="module")
def ray_held():
    """A private Ray held for the module, as a notebook holds it: the sweeps' Ray tasks reuse its worker processes."""
    acquire_ray(rl.Ray(), cpus_needed=1)
    yield
    release_ray()


@pytest.fixture(scope="module")
def first(tmp_path_factory, ray_held):
    """The CI smoke: a sweep on a private Ray, 2 runs of the tiny model (seeds 0 and 1, 4 steps, evaluated every 2)
    and 2 of a missing model; checkpoints kept for the resume test."""
    out = tmp_path_factory.mktemp("sweep")
    sweep = rl.sweep(GRID, settings=SETTINGS, steps=4, evaluate_every=2, seeds=[0, 1], out_dir=out,
                     keep_checkpoints=True, progress=False)
    return sweep, out


def test_a_sweep_runs_every_run_as_a_ray_task_and_records_the_one_that_fails(first):
    sweep, out = first
    runs = sweep.runs.set_index(["model", "seed"])
    assert list(sweep.runs["status"]) == ["done", "done", "error", "error"]
    assert "/nonexistent/model" in runs.loc[("/nonexistent/model", 0), "error"]
    events = sweeps.RunLog(out / runs.loc[("/nonexistent/model", 0), "run_id"]).events()
    assert [e["event"] for e in events] == ["start", "error"]
    assert "ValueError" in events[-1]["error"] and "does not exist" in events[-1]["error"]
    pids = {e["pid"] for run_id in sweep.runs["run_id"] for e in starts(out / run_id)}
    assert os.getpid() not in pids  # every run in a Ray worker process, not in this one
    table = sweep.table
    assert list(table.columns[:4]) == ["run_id", "algorithm", "model", "seed"]
    assert len(table) == 6 and set(table["status"]) == {"done"}  # 2 runs x evaluations at steps 0, 2, 4
    for _, curve in table.groupby("run_id"):
        assert list(curve["step"]) == [0, 2, 4]
        assert curve["tokens"].iloc[0] == 0 and curve["tokens"].is_monotonic_increasing
        assert curve["wall_s"].is_monotonic_increasing
        assert curve["greedy_accuracy"].iloc[0] == approx(0.315)  # tiny-arith before training (greedy)
        # each run's processes: its own metrics (4 steps) and reward over the steps since the last evaluation
        metrics = pd.read_json(out / curve["run_id"].iloc[0] / "metrics.jsonl", lines=True)
        assert list(metrics["step"]) == [0, 1, 2, 3]
        assert curve["reward_mean"].iloc[2] == approx(metrics["reward_mean"][2:].mean())
        assert curve["tokens"].iloc[2] == metrics["tokens_generated"].sum()
    assert table.groupby("run_id")["greedy_accuracy"].last().nunique() == 2  # the seeds differ after training


def test_a_second_call_starts_no_task_for_finished_runs_and_tries_failed_ones_again(first):
    before, out = first
    again = rl.sweep(GRID, settings=SETTINGS, steps=4, evaluate_every=2, seeds=[0, 1], out_dir=out,
                     keep_checkpoints=True, progress=False)
    # the "start" events each run's task wrote: one per Ray task started for it, by either call
    attempts = [len(starts(out / run_id)) for run_id in again.runs["run_id"]]
    assert attempts == [1, 1, 2, 2]
    assert list(again.runs["status"]) == ["done", "done", "error", "error"]
    pd.testing.assert_frame_equal(again.table, before.table)


def test_an_interrupted_run_resumes_from_its_checkpoint(first, tmp_path):
    before, out = first
    copy = tmp_path / "sweep"
    shutil.copytree(out, copy)
    finished, untouched = before.runs[before.runs["status"] == "done"]["run_id"]
    folder = copy / finished
    # as if killed after its checkpoint at step 2: no step-4 checkpoint, no step-4 evaluation, no "done"
    shutil.rmtree(folder / "checkpoints" / "step-000004")
    log = folder / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if '"done"' not in line))
    evals = folder / "evals.jsonl"
    evals.write_text("".join(line + "\n" for line in evals.read_text().splitlines() if json.loads(line)["step"] <= 2))
    again = rl.sweep({"model": ["tiny-arith"]}, settings=SETTINGS, steps=4, evaluate_every=2, seeds=[0, 1],
                     out_dir=copy, cluster="inline", progress=False)
    assert len(starts(folder)) == 2 and len(starts(copy / untouched)) == 1
    assert [e["from_step"] for e in sweeps.RunLog(folder).events() if e["event"] == "restored"] == [2]
    assert not (folder / "checkpoints").exists()  # removed once the run finished (keep_checkpoints=False)
    assert list(pd.read_json(folder / "metrics.jsonl", lines=True)["step"]) == [0, 1, 2, 3]
    resumed = again.table.set_index(["run_id", "step"])
    original = before.table.set_index(["run_id", "step"])
    for column in ["tokens", "greedy_accuracy", "sampled_accuracy", "reward_mean"]:  # as if never stopped
        assert resumed.loc[(finished, 4), column] == approx(original.loc[(finished, 4), column])


def test_bad_settings_name_the_key_and_what_it_accepts(tmp_path):
    with pytest.raises(recipes.RecipeError, match="grid.lrr: unknown key; accepted: model, task"):
        rl.Sweep({"lrr": [1e-4]}, steps=2)
    with pytest.raises(recipes.RecipeError, match=r"grid.lr: expected float, got 'fast' \(str\)"):
        rl.Sweep({"lr": [1e-4, "fast"]}, steps=2)
    with pytest.raises(recipes.RecipeError, match="grid.lr: expected a non-empty list of values, got 0.001"):
        rl.Sweep({"lr": 1e-3}, steps=2)
    with pytest.raises(recipes.RecipeError, match="settings.seed: set by the sweep"):
        rl.Sweep({"lr": [1e-4]}, steps=2, settings={"seed": 3})
    with pytest.raises(recipes.RecipeError, match=r"grid\[1\].steps: must be a positive integer, got 0"):
        rl.Sweep([{"algorithm": "grpo"}, {"algorithm": "dapo", "steps": 0}], steps=2)
    with pytest.raises(recipes.RecipeError, match="grid.algorithm.preset: 'grpox' is not one of: .*grpo"):
        rl.Sweep({"algorithm": ["grpo", "grpox"]}, steps=2)
    with pytest.raises(recipes.RecipeError, match=r"grid\[0\].seeds: expected one or more integers >= 0, got 3"):
        rl.Sweep([{"algorithm": "grpo", "seeds": 3}], steps=2)
    # the attacks: a repeated seed or value trained the same run twice into one folder and doubled its rows
    with pytest.raises(recipes.RecipeError, match=r"seeds: seed 0 appears more than once in \[0, 1, 0\]"):
        rl.Sweep({"lr": [1e-4]}, steps=2, seeds=[0, 1, 0])
    with pytest.raises(recipes.RecipeError, match=r"grid: two points make the same run grpo-seed0-\w+ \(seed 0, "
                                                  r".*\): drop the repeated value"):
        rl.Sweep({"lr": [1e-4, 0.0001]}, steps=2)


def test_run_ids_depend_on_settings_seed_and_budget_only():
    a = rl.Sweep({"algorithm": ["grpo", "dapo"], "lr": [1e-4, 3e-4]}, steps=10, seeds=[0, 1]).planned
    b = rl.Sweep({"lr": [1e-4, 3e-4], "algorithm": ["grpo", "dapo"]}, steps=10, seeds=[1, 0]).planned
    assert len(a) == 8 and len({r.run_id for r in a}) == 8 and {r.run_id for r in a} == {r.run_id for r in b}
    assert a[0].run_id.startswith("grpo-seed0-") and a[-1].run_id.startswith("dapo-seed1-")
    longer = rl.Sweep({"algorithm": ["grpo"], "lr": [1e-4]}, steps=20, seeds=[0]).planned[0]
    assert longer.run_id != a[0].run_id and longer.stops() == [20]
    assert rl.Sweep({"lr": [1e-4]}, steps=10, evaluate_every=4).planned[0].stops() == [4, 8, 10]


def test_a_point_may_set_its_own_seeds_and_keeps_its_run_ids():
    """A leaderboard's task with fewer seeds: the point's own `seeds` replace the sweep's, for that point only."""
    runs = rl.Sweep([{"algorithm": "grpo"}, {"algorithm": "dapo", "seeds": [5]}], steps=10, seeds=[0, 1]).planned
    assert [(r.settings["algorithm"], r.seed) for r in runs] == [("grpo", 0), ("grpo", 1), ("dapo", 5)]
    assert "seeds" not in runs[2].settings
    alone = rl.Sweep({"algorithm": ["dapo"]}, steps=10, seeds=[5]).planned[0]
    assert runs[2].run_id == alone.run_id  # a run is the same run however its seed was given


def test_a_leaderboard_task_runs_the_presets_that_can_train_on_it():
    arithmetic, calculator = {"task": "arithmetic"}, {"task": "calculator"}
    assert cli.cannot_run(arithmetic, "grpo") is None and cli.cannot_run(calculator, "grpo") is None
    assert cli.cannot_run(calculator, "gigpo") is None
    assert cli.cannot_run(arithmetic, "gigpo") == "they credit each turn of an episode, and this task is single-turn"
    assert cli.cannot_run(calculator, "opd") == "they distil from a teacher, and this task names none"
    assert cli.cannot_run(arithmetic | {"teacher": "tiny-arith-grpo"}, "opd") is None


# ------------------------------------------------------------------------------------------- statistics
def test_bootstrap_intervals_enumerate_every_resample_of_few_seeds():
    # [0.2, 0.6]: resample means 0.2, 0.4, 0.4, 0.6 (1/4 each); the 2.5% quantile is 0.2, the 97.5% one 0.6
    assert stats.mean_ci([0.2, 0.6]) == approx((0.4, 0.2, 0.6))
    # [0, 0, 1]: the count of 1s in a resample is Binomial(3, 1/3): means 0 (8/27), 1/3 (12/27), 2/3 (6/27), 1 (1/27);
    # P(mean <= 0) = 8/27 >= 0.025, P(mean <= 2/3) = 26/27 < 0.975: the interval is [0, 1]
    assert stats.mean_ci([0.0, 0.0, 1.0]) == approx((1 / 3, 0.0, 1.0))
    # at level 0.5: the 25% quantile is 0 (8/27 >= 1/4), the 75% one 2/3 (20/27 < 3/4 <= 26/27)
    assert stats.mean_ci([0.0, 0.0, 1.0], level=0.5) == approx((1 / 3, 0.0, 2 / 3))
    # A = [0.6, 0.7], B = [0.1, 0.2]: 16 equally likely pairs of resample means; the smallest difference, 0.6 - 0.2,
    # has probability 1/16 >= 0.025 and the largest, 0.7 - 0.1, too: the interval [0.4, 0.6] excludes 0
    assert stats.difference_ci([0.6, 0.7], [0.1, 0.2]) == approx((0.5, 0.4, 0.6))
    assert stats.difference_ci([0.0, 1.0], [0.0, 0.0]) == approx((0.5, 0.0, 1.0))


def test_monte_carlo_bootstrap_matches_the_enumeration_and_is_reproducible():
    values = [0.31, 0.35, 0.28, 0.40, 0.33, 0.37, 0.30]  # 7^7 = 823,543 resamples: more than 10,000, drawn
    every = np.array(values)[np.array(list(itertools.product(range(7), repeat=7)))].mean(1)
    exact = np.quantile(every, [0.025, 0.975], method="inverted_cdf")
    mean, lo, hi = stats.mean_ci(values)
    assert mean == approx(np.mean(values)) and (lo, hi) == approx(tuple(exact), abs=0.003)  # 10,000 draws
    assert stats.mean_ci(values) == (mean, lo, hi) and stats.mean_ci(values, seed=1) != (mean, lo, hi)


def test_auc_and_value_at_a_token_budget_by_hand():
    # trapezoids over steps 0, 2, 4: 2 * (0.3 + 0.5) / 2 + 2 * (0.5 + 0.4) / 2 = 1.7, over a span of 4: 0.425
    assert stats.auc([0, 2, 4], [0.3, 0.5, 0.4]) == approx(0.425)
    assert stats.auc([0, 10], [0.5, 0.5]) == approx(0.5) and stats.auc([0], [0.7]) == 0.7
    # at 1500 tokens, halfway between (1000, 0.5) and (2000, 0.4); past the last point: NaN
    assert stats.value_at([0, 1000, 2000], [0.3, 0.5, 0.4], 1500) == approx(0.45)
    assert np.isnan(stats.value_at([0, 1000, 2000], [0.3, 0.5, 0.4], 2500))


def curve_table() -> pd.DataFrame:
    """Two presets x two seeds, evaluated at steps 0, 2, 4 (hand-made)."""
    rows = []
    for preset, seed, accuracy, tokens in [("grpo", 0, [0.3, 0.4, 0.5], [0, 1000, 2000]),
                                           ("grpo", 1, [0.3, 0.3, 0.3], [0, 1000, 2000]),
                                           ("dapo", 0, [0.3, 0.6, 0.8], [0, 2000, 4000]),
                                           ("dapo", 1, [0.3, 0.5, 0.7], [0, 2000, 4000])]:
        for step, acc, tok in zip([0, 2, 4], accuracy, tokens):
            rows.append({"run_id": f"{preset}-{seed}", "preset": preset, "board": "arithmetic", "seed": seed,
                         "step": step, "tokens": tok, "greedy_accuracy": acc, "wall_s": 10.0 + step, "status": "done"})
    return pd.DataFrame(rows)


def test_summaries_and_differences_of_a_hand_made_table():
    per_run = stats.run_summaries(curve_table()).set_index("run_id")
    # grpo-0: AUC (2 * 0.7 / 2 + 2 * 0.9 / 2) / 4 = 0.4; dapo-0: (0.9 + 1.4) / 4 = 0.575; budget: 2000 tokens, where
    # dapo-0's curve is at step 2 (0.6) and dapo-1's too (0.5)
    assert per_run.loc["grpo-0", ["final", "auc", "at_budget"]].tolist() == approx([0.5, 0.4, 0.5])
    assert per_run.loc["dapo-0", ["final", "auc", "at_budget"]].tolist() == approx([0.8, 0.575, 0.6])
    assert per_run["budget"].unique().tolist() == [2000]
    summary = stats.summarize(per_run, ["preset"]).set_index("preset")
    assert summary.loc["dapo", ["final", "final_lo", "final_hi", "n"]].tolist() == approx([0.75, 0.7, 0.8, 2])
    versus = stats.compare(per_run, ["preset"], {"preset": "grpo"}).set_index("preset")
    assert list(versus.index) == ["dapo"]
    # final: dapo {0.8, 0.7}, grpo {0.5, 0.3}: difference 0.35, pairs from 0.7 - 0.5 = 0.2 to 0.8 - 0.3 = 0.5
    assert versus.loc["dapo", ["final_diff", "final_lo", "final_hi"]].tolist() == approx([0.35, 0.2, 0.5])
    assert versus.loc["dapo", "final_real"]
    # at 2000 tokens: dapo 0.6 and 0.5, grpo 0.5 and 0.3; the smallest difference, 0.5 - 0.5 = 0, is the interval's low
    # end: 0 is not outside it
    assert versus.loc["dapo", "at_budget_lo"] == 0 and not versus.loc["dapo", "at_budget_real"]


def test_the_leaderboard_page_from_hand_made_rows():
    spec = recipes.Leaderboard(path="board.toml", workers=2, presets=("grpo", "dapo"),
                               tasks={"arithmetic": {"model": "tiny-arith"}},
                               budgets={"arithmetic": {"steps": 4, "evaluate_every": 2, "seeds": [0, 1]}})
    page = cli.leaderboard_markdown(curve_table(), spec, command="rlbench leaderboard", minutes=1.5, commit="abc1234")
    assert "Reproduce: `rlbench leaderboard` at commit `abc1234`" in page and "**Total wall time: 1.5 min**" in page
    assert "for 4 runs, whose own times add up to 0.9 min" in page  # 4 runs of 14 s each
    assert "seeds [0, 1], 4 steps, evaluated every 2; before training: greedy accuracy 0.300" in page
    assert "| preset | final greedy accuracy | AUC | greedy at 2,000 tokens | final − GRPO |" in page
    dapo, grpo = [line for line in page.splitlines() if line.startswith("| dapo") or line.startswith("| grpo")]
    # dapo's AUCs 0.575 and 0.5 (mean 0.5375), grpo's 0.4 and 0.3: differences from 0.5 - 0.4 to 0.575 - 0.3
    assert dapo == ("| dapo | 0.750 [0.700, 0.800] | 0.537 [0.500, 0.575] | 0.550 [0.500, 0.600] | **+0.350** "
                    "[+0.200, +0.500] | **+0.188** [+0.100, +0.275] | 14.0 | 4,000 |")
    assert grpo.startswith("| grpo | 0.400 [0.300, 0.500] |") and grpo.endswith("| — | — | 14.0 | 2,000 |")


def test_the_sweep_command_checks_its_file(tmp_path, capsys):
    path = tmp_path / "lr.toml"
    path.write_text('steps = 4\nseeds = [0, 1]\n[settings]\nmodel = "tiny-arith"\n[grid]\n'
                    'algorithm = ["grpo", "dapo"]\nlr = [1e-4, 3e-4]\n')
    assert cli.main(["sweep", str(path), "grid.lrr=[1e-4]"]) == 2
    assert "rlbench sweep: grid.lrr: unknown key; accepted: model, task" in capsys.readouterr().err
    assert cli.main(["sweep", str(path), "stpes=3"]) == 2
    assert "stpes: unknown key; accepted: description, steps, evaluate_every" in capsys.readouterr().err
    assert cli.main(["sweep", str(path), "--dry-run", "steps=6"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(runs) == 8 and {r["steps"] for r in runs} == {6}
    assert {(r["settings"]["algorithm"], r["settings"]["lr"], r["seed"]) for r in runs} == set(
        itertools.product(["grpo", "dapo"], [1e-4, 3e-4], [0, 1]))
    shipped = sweeps.load(Path(__file__).parents[1] / "algorithms" / "lr-sweep.toml")
    assert len(shipped.planned) == 18 and shipped.columns == ["algorithm", "lr"]
    assert shipped.out_dir.parts[-3:] == ("runs", "sweeps", "lr-sweep")


def test_learning_curves_split_presets_across_panels_with_the_reference_in_each():
    presets = ["grpo", *"abcdefghijklmnopqrstu"]  # GRPO and 21 others, at most 6 lines a panel: 5 panels of 5 or 4
    panels = sweeps.curve_panels(presets, "grpo", per_panel=6)
    assert [len(p) for p in panels] == [6, 5, 5, 5, 5] and all(p[0] == "grpo" for p in panels)
    assert [arm for p in panels for arm in p[1:]] == presets[1:]
    assert sweeps.curve_panels(["a", "b"], "grpo", per_panel=6) == [["a", "b"]]
