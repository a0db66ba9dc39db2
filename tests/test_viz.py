import base64
import math
import threading
import time

import pandas as pd
import pytest
import torch
from floats import approx
from matplotlib.figure import Figure

import rlbench as rl
from rlbench import viz
from rlbench.runs.sinks import read_jsonl

SMALL = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline",
             prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, threads=1)
TITLES = ["reward", "KL to reference", "entropy", "response length (tokens)", "stage timings (s)"]
"""The default panels of a GRPO run on arithmetic: accuracy is the reward there, and on-policy nothing is clipped."""


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):
    """A session after 3 GRPO steps, logging to LOG_DIR/viz/metrics.jsonl."""
    s = rl.Session(**SMALL, seed=0, log_dir=str(tmp_path_factory.mktemp("logs")), run_name="viz")
    s.run(steps=3, progress=False)
    return s


def _lines(ax):
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_plot_has_every_panel_with_data(trained):
    fig = viz.plot(trained)
    assert isinstance(fig, Figure)
    assert [ax.get_title() for ax in fig.axes] == TITLES
    for ax in fig.axes:
        lines = _lines(ax)
        assert lines, f"panel {ax.get_title()!r} is empty"
        for line in lines.values():
            assert list(line.get_xdata()) == [0, 1, 2] and all(math.isfinite(y) for y in line.get_ydata())
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert list(_lines(panels["stage timings (s)"])) == ["rollout", "score", "advantage", "update", "sync"]
    reward = _lines(panels["reward"])["reward_mean"].get_ydata()
    assert list(reward) == trained.metrics["reward_mean"].tolist()


def test_plot_reads_a_jsonl_log_and_compares_runs(trained):
    log = f"{trained.config.log_dir}/viz/metrics.jsonl"
    from_log = viz.plot(log)
    assert [ax.get_title() for ax in from_log.axes] == TITLES
    assert list(_lines(from_log.axes[0])["reward_mean"].get_ydata()) == trained.metrics["reward_mean"].tolist()

    other = pd.DataFrame({"step": [0, 1], "reward_mean": [0.1, 0.3], "time_step": [1.0, 2.0]})
    fig = viz.plot({"logged": log, "other": other}, smooth=2)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(_lines(panels["reward"])) == {"logged", "other"}
    assert list(_lines(panels["KL to reference"])) == ["logged"]  # "other" has no KL column
    timings = _lines(panels["stage timings (s)"])  # one total per run when comparing
    assert list(timings["other"].get_ydata()) == [1.0, 1.5]  # smoothed: rolling mean over 2 steps
    assert list(timings["logged"].get_ydata())[0] == trained.metrics["time_step"][0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["logged", "other"]

    only = viz.plot(other, panels=["reward_mean", "grad_norm"])  # a panel without data is left out
    assert [ax.get_title() for ax in only.axes] == ["reward"]  # a column's title in words


def test_default_panels_leave_out_what_says_nothing_and_show_an_agents_tools():
    # accuracy equal to the reward, clipping all 0: left out by default, drawn when asked for by name
    run = pd.DataFrame({"step": [0, 1, 2], "reward_mean": [0.1, 0.4, 0.5], "accuracy": [0.1, 0.4, 0.5],
                        "clip_frac": [0.0, 0.0, 0.0], "entropy": [1.0, 0.9, 0.8]})
    assert [ax.get_title() for ax in viz.plot(run).axes] == ["reward", "entropy"]
    assert [ax.get_title() for ax in viz.plot(run, panels=["accuracy", "clip_frac"]).axes] == ["accuracy",
                                                                                              "clip fraction"]
    agentic = run.assign(accuracy=[0.0, 0.3, 0.5], turns_mean=[1.2, 1.6, 1.9], tool_calls_mean=[0.4, 0.8, 1.0],
                         tool_errors_mean=[0.1, 0.05, 0.0], tool_success_rate=[0.75, 0.94, 1.0])
    fig = viz.plot(agentic)
    assert [ax.get_title() for ax in fig.axes] == ["reward", "accuracy", "turns per episode", "tool calls per episode",
                                                   "tool success", "entropy"]
    assert list(_lines(fig.axes[3])) == ["calls", "errors"]
    # two runs whose accuracy differs from their reward in one of them: the panel stays
    assert "accuracy" in [ax.get_title() for ax in viz.plot({"a": run, "b": agentic}).axes]


def test_rollout_table_and_sample_plot(trained):
    batch = trained.last_batch
    table = viz.rollout_table(batch)
    assert list(table.columns) == ["group", "prompt", "completion", "reward", "advantage", "length"]
    assert table["completion"].tolist() == batch["completion"] and len(table) == 16
    for _, group in table.groupby("group"):  # GRPO: advantages of a group sum to 0
        assert abs(group["advantage"].sum()) < 1e-4
    assert viz.rollout_table(batch.select("prompt", "completion", "group_ids", "response_mask")).columns.tolist() == [
        "group", "prompt", "completion", "length"]

    row = int(table["advantage"].abs().idxmax())
    fig = viz.plot_sample(batch, row, trained.tokenizer)
    top, bottom = fig.axes
    length = int(table["length"][row])
    assert set(_lines(top)) == {"sampler_logp", "old_logp", "ref_logp"}
    assert all(len(line.get_xdata()) == length for line in _lines(top).values())
    assert [patch.get_height() for patch in bottom.patches] == approx(
        batch["advantages"][row][:length].tolist())
    assert len(bottom.get_xticklabels()) == length


def test_rollout_table_shows_a_stray_byte_readably(trained):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer, batch = trained.tokenizer, trained.last_batch
    ids = tokenizer.convert_tokens_to_ids(["1", bytes_to_unicode()[0xB7], "9"])  # a byte that forms no character
    response_ids, mask = batch["response_ids"].clone(), batch["response_mask"].clone()
    response_ids[0, :3], mask[0], mask[0, :3] = torch.tensor(ids), 0, 1
    completions = ["1\ufffd9", *batch["completion"][1:]]
    odd = batch.with_columns(response_ids=response_ids, response_mask=mask, completion=completions)
    assert viz.rollout_table(odd)["completion"][0] == "1\ufffd9"  # without the tokenizer: the decoded text
    assert viz.rollout_table(odd, tokenizer)["completion"][0] == "1<0xB7>9"
    assert viz.rollout_table(odd, tokenizer)["completion"][1:].tolist() == completions[1:]


def test_dashboard_receives_rows_and_rollouts(tiny_dir):
    s = rl.Session(**SMALL, seed=1, log_dir=None)
    dash = viz.Dashboard(s, refresh_seconds=0)
    assert dash._on_step in s.callbacks
    s.run(steps=3, progress=False)
    assert dash.metrics["step"].tolist() == [0, 1, 2]
    assert dash.progress.value == 3
    assert dash.curves.value[:4] == b"\x89PNG"
    reward = _lines(dash.figure.axes[0])["reward_mean"]
    assert list(reward.get_ydata()) == s.metrics["reward_mean"].tolist()
    assert [value for _, value in dash.step_picker.options] == [viz.LATEST, 2, 1, 0]  # "latest", then newest first
    last = viz.rollout_table(s.last_batch)
    assert "step 2," in dash.samples.value
    assert all(c in dash.samples.value for c in last[last["group"] == 0]["completion"])
    dash.group_picker.value = 3
    assert last[last["group"] == 3]["prompt"].iloc[0] in dash.samples.value

    dash.step_picker.value = 1  # an older step holds while training goes on
    s.run(steps=1, progress=False)
    assert dash.step_picker.value == 1 and "step 1," in dash.samples.value
    dash.step_picker.value = viz.LATEST  # "latest" follows the newest
    s.run(steps=1, progress=False)
    assert dash.step_picker.value == viz.LATEST and "step 4," in dash.samples.value
    dash.close()
    assert dash._on_step not in s.callbacks


@pytest.fixture
def notebook_outputs():
    """What IPython would send a notebook: (data, display_id, update) per output, from a real InteractiveShell whose
    display publisher keeps the messages instead of sending them to a frontend."""
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    sent = []

    class Kept(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            sent.append((data, (transient or {}).get("display_id"), update))

    shell = InteractiveShell.instance()
    shell.display_pub = Kept(shell=shell)
    yield sent
    InteractiveShell.clear_instance()


def test_a_finished_run_leaves_a_static_record_where_the_dashboard_was(tiny_dir, notebook_outputs):
    from IPython.display import display

    s = rl.Session(**SMALL, seed=5, log_dir=None)
    dash = viz.Dashboard(s)
    assert dash.stop_button.disabled  # nothing runs yet
    dash.start(2)
    display(dash)
    [(live, display_id, update)] = notebook_outputs
    assert "application/vnd.jupyter.widget-view+json" in live and display_id and not update
    dash.wait(timeout=60)
    assert dash.stop_button.disabled and not dash.running
    [(record, same_id, update)] = notebook_outputs[1:]  # the live panel's output replaced: no widget left in it
    assert same_id == display_id and update and set(record) == {"image/png", "text/plain"}
    assert "finished, 2 steps" in record["text/plain"] and s.run_name in record["text/plain"]
    assert base64.b64decode(record["image/png"])[:4] == b"\x89PNG"

    frozen = viz.Dashboard(s.metrics)  # a finished run is shown as its record straight away
    display(frozen)
    assert set(notebook_outputs[-1][0]) == {"image/png", "text/plain"} and "2 steps" in notebook_outputs[-1][0]["text/plain"]


def test_notebook_progress_bar_is_a_plain_output_updated_in_place(notebook_outputs, capsys):
    from rlbench.runs.progress import NotebookBar

    with NotebookBar(total=3, desc="my-run", mininterval=0) as bar:
        for _ in range(3):
            bar.update(1)
    ids = {display_id for _, display_id, _ in notebook_outputs}
    assert len(ids) == 1 and None not in ids  # one output, replaced as the bar moves
    assert all(set(data) == {"text/plain"} for data, _, _ in notebook_outputs)
    last = notebook_outputs[-1][0]["text/plain"]
    assert last.startswith("my-run: 100%") and "3/3" in last
    assert capsys.readouterr().err == ""  # nothing on stderr (a notebook shows it as a red block)


def test_stop_button_ends_run_after_the_current_step(tiny_dir):
    s = rl.Session(**SMALL, seed=2, log_dir=None)
    dash = viz.Dashboard(s)

    def click_at_step_1(session, row):  # what a person clicking during step 1 does
        if row["step"] == 1:
            dash.stop_button.click()

    s.callbacks.append(click_at_step_1)
    assert len(s.run(steps=10, progress=False)) == 2
    assert "stopping" in dash.status.value
    s.callbacks.remove(click_at_step_1)
    dash.status.value = "idle"
    dash.stop()  # with no run going: nothing
    assert dash.status.value == "idle"
    assert len(s.run(steps=2, progress=False)) == 4  # neither click stops the next run


def test_start_trains_in_background_and_stop_works(tiny_dir):
    s = rl.Session(**SMALL, seed=3, log_dir=None)
    dash = viz.Dashboard(s)
    dash.start(1000)
    assert dash.progress.description.endswith("/1000") and not dash.stop_button.disabled and dash.running
    deadline = time.monotonic() + 60
    while not s.history and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.history, "no step finished within 60 s"
    dash.stop_button.click()
    clicked_at = len(s.history)
    metrics = dash.wait(timeout=60)
    assert clicked_at <= len(metrics) <= clicked_at + 1  # the step in progress finishes, no more
    assert "stopped after" in dash.status.value and dash.metrics["step"].tolist() == metrics["step"].tolist()
    assert dash.stop_button.disabled and not dash.running
    assert not any(t.name == "rlbench-dashboard" and t.is_alive() for t in threading.enumerate())


def test_background_error_is_shown_and_reraised(tiny_dir):
    s = rl.Session(**SMALL, seed=4, log_dir=None)
    dash = viz.Dashboard(s)

    def fail(session, row):
        raise RuntimeError("reward server down")

    s.callbacks.append(fail)
    dash.start(5)
    with pytest.raises(RuntimeError, match="reward server down"):
        dash.wait(timeout=60)
    assert "error" in dash.status.value and len(s.history) == 1


def test_frozen_dashboard_from_a_log(trained):
    folder = f"{trained.config.log_dir}/viz"
    dash = viz.Dashboard(folder)
    pd.testing.assert_frame_equal(dash.metrics, read_jsonl(f"{folder}/metrics.jsonl"))
    assert dash.stop_button.disabled and dash.progress.value == 3 and "3 steps" in dash.status.value
    assert [ax.get_title() for ax in dash.figure.axes] == TITLES
    with pytest.raises(RuntimeError, match="finished run"):
        dash.start(1)
    frozen = viz.Dashboard(trained.metrics)
    assert list(_lines(frozen.figure.axes[0])["reward_mean"].get_ydata()) == trained.metrics["reward_mean"].tolist()


def test_session_plot_and_dashboard(trained):
    fig = trained.plot()
    assert [ax.get_title() for ax in fig.axes] == TITLES
    dash = trained.dashboard()
    assert isinstance(dash, viz.Dashboard) and dash._on_step in trained.callbacks
    dash.close()
