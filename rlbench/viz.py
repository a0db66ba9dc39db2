"""Plots and the notebook dashboard: look at a run while it trains, or afterwards from its log.

    rl.viz.plot(session)                          # or a metrics DataFrame, or a run's metrics.jsonl / folder
    rl.viz.plot({"grpo": s1, "dapo": s2})         # several runs: one line each, in the same panels
    rl.viz.rollout_table(batch)                   # one row per sample: prompt, completion, reward, advantage
    rl.viz.plot_sample(batch, 0, s.tokenizer)     # one sample's per-token log-probs and advantages
    rl.viz.Dashboard(session)                     # live: progress, curves, the last rollouts, a Stop button
    rl.viz.Dashboard("runs/my-run")               # frozen: the same curves for a finished run

Everything here reads a run through what the session exposes (`metrics`, `history`, `last_batch`,
`callbacks`, `request_stop()`); nothing below the session is imported.
"""

from __future__ import annotations

import html
import io
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlbench.sinks import read_jsonl

TIMINGS = ("time_rollout", "time_score", "time_advantage", "time_update", "time_sync")
"""The per-stage wall times (seconds) a session's metrics row carries."""


@dataclass(frozen=True)
class Panel:
    """One subplot: a title and the metric columns it draws."""

    title: str
    columns: tuple[str, ...]
    """Columns drawn for a single run (those the run has; a panel whose columns no run has is left out)."""
    compare: str | None = None
    """The one column drawn per run when several runs share the panel (None = the first of `columns` present)."""


PANELS = (
    Panel("reward", ("reward_mean",)),
    Panel("accuracy", ("accuracy",)),
    Panel("KL to reference", ("kl_loss", "reward_kl")),
    Panel("entropy", ("entropy",)),
    Panel("clip fraction", ("clip_frac", "clip_frac_lower")),
    Panel("response length (tokens)", ("response_length",)),
    Panel("stage timings (s)", TIMINGS, compare="time_step"),
)
"""The default panels of `plot` and the dashboard, in order."""


# ------------------------------------------------------------------------------------- metrics
def load_metrics(source) -> pd.DataFrame:
    """The metrics DataFrame of a run: a DataFrame, anything with `.metrics` (a Session), a list of rows,
    or the path of a run's `metrics.jsonl` (or of the folder holding it)."""
    if isinstance(source, pd.DataFrame):
        return source
    if hasattr(source, "metrics"):
        return source.metrics
    if isinstance(source, (str, Path)):
        path = Path(source)
        return read_jsonl(path / "metrics.jsonl" if path.is_dir() else path)
    if isinstance(source, Sequence):
        return pd.DataFrame(list(source))
    raise TypeError(f"cannot read metrics from a {type(source).__name__}: pass a Session, a DataFrame or a path")


def _runs(source) -> dict[str, pd.DataFrame]:
    """{label: metrics} of one run or of a mapping of runs."""
    if isinstance(source, Mapping):
        return {str(name): load_metrics(run) for name, run in source.items()}
    return {_label(source): load_metrics(source)}


def _label(source) -> str:
    if isinstance(source, (str, Path)):
        path = Path(source)
        return (path if path.is_dir() else path.parent).name
    algorithm = getattr(source, "algorithm", None)
    return getattr(algorithm, "name", "run")


# ---------------------------------------------------------------------------------------- plots
def plot(source, *, panels: Sequence[Panel | str] = PANELS, smooth: int = 1, columns: int = 4,
         title: str | None = None) -> Figure:
    """A Figure with one panel per metric group (reward, accuracy, KL, entropy, clip fraction, response
    length, stage timings) for a run, or for several runs given as `{name: run}`, one line each.

    A run is anything `load_metrics` reads (a Session, a DataFrame, a metrics.jsonl path). `panels` may mix
    `Panel`s and column names; panels with no data are left out. `smooth` > 1 draws a rolling mean over that
    many steps on top of the raw values. The Figure is not left open in pyplot: a notebook shows it once, a
    script saves it with `fig.savefig(path)`.
    """
    import matplotlib.pyplot as plt  # creating it through pyplot sets up the notebook's inline display

    fig = plt.figure()
    plt.close(fig)
    return draw(fig, _runs(source), panels=panels, smooth=smooth, columns=columns, title=title)


def draw(fig: Figure, runs: Mapping[str, pd.DataFrame], *, panels: Sequence[Panel | str] = PANELS,
         smooth: int = 1, columns: int = 4, title: str | None = None) -> Figure:
    """Draw the panels of `runs` ({label: metrics}) into an empty Figure (`plot` without pyplot)."""
    wanted = [Panel(p, (p,)) if isinstance(p, str) else p for p in panels]
    shown = [p for p in wanted if any(c in m.columns for m in runs.values() for c in p.columns)]
    if not shown:
        fig.set_size_inches(4, 1.5)
        fig.text(0.5, 0.5, "no metrics yet", ha="center", va="center")
        return fig
    ncols = min(columns, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    fig.set_size_inches(3.6 * ncols, 2.6 * nrows)
    fig.set_layout_engine("constrained")
    for i, panel in enumerate(shown):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw_panel(ax, panel, runs, smooth)
    if len(runs) > 1:
        handles, labels = _legend_entries(fig)
        fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 6), frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def _draw_panel(ax, panel: Panel, runs: Mapping[str, pd.DataFrame], smooth: int) -> None:
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for color, (name, metrics) in enumerate(runs.items()):
        present = [c for c in panel.columns if c in metrics.columns]
        if len(runs) > 1:  # one line per run: the panel's comparison column, else its first one present
            column = panel.compare if panel.compare in metrics.columns else next(iter(present), None)
            lines = [(column, name)] if column else []
        else:
            lines = [(c, c) for c in present]
        for j, (column, label) in enumerate(lines):
            _line(ax, metrics, column, label, f"C{color if len(runs) > 1 else j}", smooth)
    if len(runs) == 1 and len(ax.lines) > 1:
        ax.legend(fontsize=7)


def _line(ax, metrics: pd.DataFrame, column: str, label: str, color: str, smooth: int) -> None:
    x = metrics["step"] if "step" in metrics.columns else metrics.index
    y = metrics[column].astype(float)
    if smooth > 1:
        ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
        y = y.rolling(smooth, min_periods=1).mean()
    ax.plot(x, y, color=color, label=label, linewidth=1.3)


def _legend_entries(fig: Figure):
    """One legend entry per label across all panels (a run missing from the first panel still appears)."""
    entries = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                entries.setdefault(line.get_label(), line)
    return list(entries.values()), list(entries)


def rollout_table(batch) -> pd.DataFrame:
    """One row per sample of a Batch: group, prompt, completion, reward, advantage (the mean over the
    response's tokens), response length; only the columns the batch has reached so far."""
    table = {"group": batch["group_ids"].tolist(), "prompt": list(batch["prompt"]),
             "completion": list(batch["completion"])}
    if "reward" in batch:
        table["reward"] = batch["reward"].tolist()
    mask_B_T = batch["response_mask"].float()
    if "advantages" in batch:
        table["advantage"] = ((batch["advantages"] * mask_B_T).sum(-1) / mask_B_T.sum(-1).clamp(min=1)).tolist()
    table["length"] = mask_B_T.sum(-1).long().tolist()
    return pd.DataFrame(table)


def plot_sample(batch, row: int = 0, tokenizer=None) -> Figure:
    """One sample's response tokens: the log-prob the sampler drew each with (and the policy's and the
    reference's, when computed) above, the per-token advantage below."""
    import matplotlib.pyplot as plt

    valid_T = batch["response_mask"][row].bool()
    ids = batch["response_ids"][row][valid_T].tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
    x = range(len(ids))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(max(4.0, 0.45 * len(ids) + 2), 4),
                                      layout="constrained")
    plt.close(fig)
    for j, column in enumerate(c for c in ("sampler_logp", "old_logp", "ref_logp") if c in batch):
        top.plot(x, batch[column][row][valid_T].tolist(), marker="o", linestyle="-" if j == 0 else "--",
                 label=column)
    top.set_ylabel("log-prob")
    top.legend(fontsize=7)
    if "advantages" in batch:
        advantages = batch["advantages"][row][valid_T].tolist()
        bottom.bar(x, advantages, color=["C2" if a >= 0 else "C3" for a in advantages])
        bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel("advantage")
    bottom.set_xticks(list(x), [repr(t)[1:-1] for t in tokens], fontsize=8)
    reward = f"   reward {float(batch['reward'][row]):.3g}" if "reward" in batch else ""
    top.set_title(f"{batch['prompt'][row]!r} → {batch['completion'][row]!r}{reward}", fontsize=9)
    return fig


# ------------------------------------------------------------------------------------ dashboard
class Dashboard:
    """A notebook panel over a run: progress, live curves, a browser over the last rollouts, a Stop button.

    `Dashboard(session)` registers a callback on the session, so every step (`s.step()`, `s.run(n)`, or
    `start(n)`) updates it. The Stop button calls `session.request_stop()`: `run()` returns after the
    step in progress. Jupyter handles a click only while no cell is executing, so `start(n)` trains in a
    background thread and returns at once; `wait()` blocks until that run ends.

    `Dashboard(metrics_df_or_path)` shows a finished run (no session: no rollouts, no Stop).
    Attributes for scripts and tests: `metrics`, `figure` (last drawn curves), the widgets `progress`,
    `status`, `stop_button`, `curves`, `step_picker`, `group_picker`, `samples`, and `widget` (all of it).
    """

    def __init__(self, source, *, panels: Sequence[Panel | str] = PANELS, smooth: int = 1,
                 refresh_seconds: float = 2.0, keep_steps: int = 10, max_chars: int = 120):
        import ipywidgets as w

        self.session = source if hasattr(source, "callbacks") else None
        rows = self.session.history if self.session is not None else load_metrics(source).to_dict("records")
        self._rows: list[dict] = list(rows)
        self.label = _label(source)
        self.panels, self.smooth, self.refresh_seconds, self.max_chars = panels, smooth, refresh_seconds, max_chars
        self.figure: Figure | None = None
        self._rollouts: deque[tuple[int, pd.DataFrame]] = deque(maxlen=keep_steps)
        self._lock = threading.RLock()
        self._drawn_rows, self._drawn_at = -1, 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._target: int | None = None

        self.progress = w.IntProgress(min=0, max=1, description="steps", bar_style="info")
        self.status = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="run() returns after the step in progress", disabled=self.session is None)
        self.stop_button.on_click(lambda _: self.stop())
        self.curves = w.Image(format="png")
        self.step_picker = w.Dropdown(description="rollouts of", options=[])
        self.group_picker = w.IntSlider(description="prompt", min=0, max=0)
        self.samples = w.HTML()
        self.step_picker.observe(lambda _: self._show_rollouts(), names="value")
        self.group_picker.observe(lambda _: self._show_rollouts(), names="value")
        browser = w.VBox([w.HBox([self.step_picker, self.group_picker]), self.samples])
        self.widget = w.VBox([w.HBox([self.progress, self.stop_button, self.status]), self.curves, browser])

        if self.session is not None:
            if self.session.last_batch is not None:
                self._keep_rollouts(self.session.step_count - 1, self.session.last_batch)
            self.session.callbacks.append(self._on_step)
        self.refresh()

    # ------------------------------------------------------------------------------ public
    @property
    def metrics(self) -> pd.DataFrame:
        """The rows this dashboard has received (or loaded), one per step."""
        with self._lock:
            return pd.DataFrame(self._rows)

    def start(self, steps: int) -> None:
        """Train `steps` more steps in a background thread: the cell returns and the Stop button stays live.
        Leave the session alone (no other cell calling it) until `wait()` returns."""
        if self.session is None:
            raise RuntimeError("this dashboard shows a finished run: there is no session to train")
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run started from this dashboard is still going: stop() or wait() first")
        self._target, self._error = self.session.step_count + steps, None
        self._update_progress()
        self._thread = threading.Thread(target=self._train, args=(steps,), name="rlbench-dashboard", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> pd.DataFrame:
        """Block until the run started by `start` ends; re-raise its error; return the session's metrics."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the run is still going after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.session.metrics

    def stop(self) -> None:
        """What the Stop button does: ask the session's `run()` to return after the step in progress."""
        if self.session is not None:
            self.session.request_stop()
            self.status.value = "<b>stopping</b> after the step in progress…"

    def refresh(self) -> None:
        """Redraw the curves now (during a run they are redrawn after a step when `refresh_seconds` have
        passed since the last drawing: drawing takes ~0.3 s)."""
        with self._lock:
            rows = len(self._rows)
            self._update_progress()
            self.figure = draw(Figure(), {self.label: pd.DataFrame(self._rows)}, panels=self.panels,
                               smooth=self.smooth)
            buffer = io.BytesIO()
            self.figure.savefig(buffer, format="png", dpi=80)
            self.curves.value = buffer.getvalue()
            self._drawn_rows, self._drawn_at = rows, time.perf_counter()
        if self.session is None:
            self.status.value = f"finished run <b>{html.escape(self.label)}</b>: {rows} steps"
            self.samples.value = "<i>rollouts are kept only while a session runs</i>"

    def close(self) -> None:
        """Detach from the session and close the widgets."""
        if self.session is not None and self._on_step in self.session.callbacks:
            self.session.callbacks.remove(self._on_step)
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        if self._drawn_rows != len(self._rows):
            self.refresh()
        return self.widget._repr_mimebundle_(**kwargs)

    # ----------------------------------------------------------------------------- internals
    def _on_step(self, session, row: dict) -> None:
        """The session callback: keep the row and the batch's rollouts, update the labels, maybe redraw."""
        with self._lock:
            self._rows.append(row)
            self._keep_rollouts(row["step"], session.last_batch)
            self._update_progress()
            self.status.value = _summary(row)
            if time.perf_counter() - self._drawn_at >= self.refresh_seconds:
                self.refresh()

    def _train(self, steps: int) -> None:
        try:
            self.session.run(steps, progress=False)
        except BaseException as error:  # shown on the dashboard, re-raised by wait()
            self._error = error
        self.refresh()
        last = self.session.step_count
        if self._error is not None:
            self.status.value = f"<b>error</b> at step {last}: {html.escape(repr(self._error))}"
        else:
            ended = "finished" if last >= self._target else "stopped"
            self.status.value = f"<b>{ended}</b> after step {last - 1}. " + _summary(self._rows[-1])

    def _update_progress(self) -> None:
        done = len(self._rows)
        target = self._target if self._target is not None else done
        self.progress.max = max(target, done, 1)
        self.progress.value = done
        self.progress.description = f"{done}/{target}" if self._target is not None else f"{done} steps"

    def _keep_rollouts(self, step: int, batch) -> None:
        if batch is None:
            return
        self._rollouts.append((step, rollout_table(batch)))
        self.step_picker.options = [(f"step {s}", s) for s, _ in reversed(self._rollouts)]
        self.step_picker.value = step
        self._show_rollouts()

    def _show_rollouts(self) -> None:
        """The samples of one prompt group of the chosen step: completion, reward, advantage, length."""
        table = dict(self._rollouts).get(self.step_picker.value)
        if table is None:
            return
        groups = sorted(table["group"].unique())
        self.group_picker.max = len(groups) - 1
        group = table[table["group"] == groups[min(self.group_picker.value, len(groups) - 1)]]
        shown = group.drop(columns=["group", "prompt"]).assign(
            completion=[_short(c, self.max_chars) for c in group["completion"]])
        prompt = html.escape(_short(group["prompt"].iloc[0], self.max_chars))
        head = f"<p><b>prompt</b> {prompt} ({len(group)} samples)</p>"
        self.samples.value = head + shown.to_html(index=False, float_format=lambda v: f"{v:.3g}")


def _summary(row: dict) -> str:
    parts = [f"step {row.get('step', '?')}"]
    for name in ("reward_mean", "accuracy", "time_step"):
        if name in row:
            parts.append(f"{name} {row[name]:.3g}")
    return html.escape(" · ".join(parts))


def _short(text, max_chars: int) -> str:
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


__all__ = ["PANELS", "TIMINGS", "Dashboard", "Panel", "draw", "load_metrics", "plot", "plot_sample", "rollout_table"]
