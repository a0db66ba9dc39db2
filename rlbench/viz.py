"""Plots and the notebook dashboard: look at a run while it trains, or afterwards from its log.

    rl.viz.plot(session)                          # or a metrics DataFrame, or a run's metrics.jsonl / folder
    rl.viz.plot({"grpo": s1, "dapo": s2})         # several runs: one line each, in the same panels
    rl.viz.rollout_table(batch, s.tokenizer)      # one row per sample: prompt, completion, reward, advantage
    rl.viz.plot_sample(batch, 0, s.tokenizer)     # one sample's per-token log-probs and advantages
    rl.viz.Dashboard(session)                     # live: progress, curves, the last rollouts, a Stop button
    rl.viz.Dashboard("runs/my-run")               # frozen: the same curves for a finished run

Everything here reads a run through what the session exposes (`metrics`, `history`, `last_batch`,
`callbacks`, `request_stop()`); nothing below the session is imported.
"""

from __future__ import annotations

import asyncio
import base64
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

from rlbench.models import readable_decode
from rlbench.runs.sinks import read_jsonl

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
    labels: tuple[str, ...] | None = None
    """The legend's names of `columns` (None = the column names)."""


PANELS = (
    Panel("reward", ("reward_mean",)),
    Panel("accuracy", ("accuracy",)),
    Panel("turns per episode", ("turns_mean",)),
    Panel("tool calls per episode", ("tool_calls_mean", "tool_errors_mean"), labels=("calls", "errors")),
    Panel("tool success", ("tool_success_rate",)),
    Panel("KL to reference", ("kl_loss", "reward_kl")),
    Panel("entropy", ("entropy",)),
    Panel("clip fraction", ("clip_frac", "clip_frac_lower")),
    Panel("response length (tokens)", ("response_length",)),
    Panel("expert load (1 = balanced)", ("router_imbalance", "router_aux_loss"), labels=("E x top share", "aux loss")),
    Panel("router entropy (nats)", ("router_entropy",)),
    Panel("stage timings (s)", TIMINGS, compare="time_step", labels=tuple(t.removeprefix("time_") for t in TIMINGS)),
)
"""The default panels of `plot` and the dashboard, in order (an agentic task's show its turns and tools, a mixture of
experts' its routing: `rlbench.policy.router`). Those
that say nothing for the runs drawn are left out: no data, only zeros (clipping on-policy, KL without a
reference), or the same lines as a panel before them (accuracy where it is the reward)."""

TITLES = {"reward_mean": "reward", "accuracy": "accuracy", "entropy": "entropy", "kl_loss": "KL to reference",
          "grad_norm": "gradient norm", "advantage_abs_mean": "mean |advantage|", "approx_kl": "KL old → new policy",
          "clip_frac": "clip fraction", "filter_rounds": "extra rollout rounds (dynamic sampling)",
          "sampler_kl": "KL sampler → trainer", "staleness_mean": "staleness (updates)", "teacher_kl": "KL to the teacher",
          "correction/outside_frac": "tokens outside the correction's bounds", "time_step": "step time (s)",
          "trainer_wait_s": "trainer waiting for samples (s)", "response_length": "response length (tokens)",
          "turns_mean": "turns per episode", "tool_calls_mean": "tool calls per episode",
          "tool_success_rate": "tool success"}
"""A panel given as a column name takes its title from here (the name itself when it is not here)."""


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
    wanted = [Panel(TITLES.get(p, p), (p,)) if isinstance(p, str) else p for p in panels]
    shown = [p for p in wanted if any(c in m.columns for m in runs.values() for c in p.columns)]
    if panels is PANELS:
        shown = _informative(shown, runs)
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
        fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 6), frameon=False, fontsize=11)
    if title:
        fig.suptitle(title)
    return fig


def _informative(panels: list[Panel], runs: Mapping[str, pd.DataFrame]) -> list[Panel]:
    """The panels that say something: a line other than 0 (or missing) throughout, and lines other than those of
    a panel kept before them."""
    kept, seen = [], []
    for panel in panels:
        data = [tuple(m[c].fillna(0).tolist()) for m in runs.values() for c in panel.columns if c in m.columns]
        if all(not any(values) for values in data) or data in seen:
            continue
        kept.append(panel)
        seen.append(data)
    return kept


def _draw_panel(ax, panel: Panel, runs: Mapping[str, pd.DataFrame], smooth: int) -> None:
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step", fontsize=9)
    ax.tick_params(labelsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for color, (name, metrics) in enumerate(runs.items()):
        present = [c for c in panel.columns if c in metrics.columns]
        if len(runs) > 1:  # one line per run: the panel's comparison column, else its first one present
            column = panel.compare if panel.compare in metrics.columns else next(iter(present), None)
            lines = [(column, name)] if column else []
        else:
            names = dict(zip(panel.columns, panel.labels or panel.columns))
            lines = [(c, names[c]) for c in present]
        for j, (column, label) in enumerate(lines):
            _line(ax, metrics, column, label, f"C{color if len(runs) > 1 else j}", smooth)
    if len(runs) == 1 and len(ax.lines) > 1:  # below the panel, where it covers no line
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False,
                  handlelength=1.2, columnspacing=0.8)



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


def rollout_table(batch, tokenizer=None) -> pd.DataFrame:
    """One row per sample of a Batch: group, prompt, completion, reward, advantage (the mean over the
    response's tokens), response length; only the columns the batch has reached so far. With the `tokenizer`,
    a completion holding a byte that forms no character shows it as `<0xNN>` (`rl.models.readable_decode`)."""
    completions = list(batch["completion"])
    if tokenizer is not None:
        for row, text in enumerate(completions):
            if "\ufffd" in text:
                completions[row] = readable_decode(tokenizer, batch["response_ids"][row][
                    batch["response_mask"][row].bool()].tolist())
    table = {"group": batch["group_ids"].tolist(), "prompt": list(batch["prompt"]), "completion": completions}
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
    tokens = [readable_decode(tokenizer, [i]) for i in ids] if tokenizer is not None else [str(i) for i in ids]
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
LATEST = -1
"""The rollout browser's "latest" choice: it follows the newest step (any other choice holds its step)."""


class Dashboard:
    """A notebook panel over a run: progress, live curves, a browser over the last rollouts, a Stop button.

    `Dashboard(session)` registers a callback on the session, so every step (`s.step()`, `s.run(n)`, or
    `start(n)`) updates it. Jupyter handles a click only while no cell is executing, so `start(n)` trains in a
    background thread and returns at once; the Stop button (live only during such a run) ends it after the step
    in progress. To wait for the run in a later cell, `await dash.wait_async()`: the cell waits and clicks are
    still handled, also under Run All. The blocking `wait()` is for scripts: in a notebook it holds every click
    until the run is over.

    When a `start` run ends, every displayed copy of the dashboard is replaced by a static record, an image of
    the curves titled with how the run ended, which a saved notebook shows without a kernel (a widget would show
    "Error displaying widget"); display `dash` again for the live panel and its rollout browser.
    `Dashboard(metrics_df_or_path)` shows a finished run, as that static record (no session: no rollouts, no Stop).

    Attributes for scripts and tests: `metrics`, `figure` (last drawn curves), the widgets `progress`,
    `status`, `stop_button`, `curves`, `step_picker`, `group_picker`, `samples`, and `widget` (all of it).
    """

    def __init__(self, source, *, panels: Sequence[Panel | str] = PANELS, smooth: int = 1,
                 refresh_seconds: float = 2.0, keep_steps: int = 10, max_chars: int = 120):
        import ipywidgets as w

        self.session = source if hasattr(source, "callbacks") else None
        rows = self.session.history if self.session is not None else load_metrics(source).to_dict("records")
        self._rows: list[dict] = list(rows)
        self.label = getattr(self.session, "run_name", None) or _label(source)
        self.panels, self.smooth, self.refresh_seconds, self.max_chars = panels, smooth, refresh_seconds, max_chars
        self.figure: Figure | None = None
        self._rollouts: deque[tuple[int, pd.DataFrame]] = deque(maxlen=keep_steps)
        self._lock = threading.RLock()
        self._drawn_rows, self._drawn_at = -1, 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._target: int | None = None
        self._active = self._stopping = False  # a `start` run is going / was asked to stop
        self._displays: list = []  # the IPython display handles of the live panel, replaced by the record at the end

        self.progress = w.IntProgress(min=0, max=1, description="steps", bar_style="info")
        self.status = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True,
                                    tooltip="the run ends after the step in progress")
        self.stop_button.on_click(lambda _: self.stop())
        self.curves = w.Image(format="png")
        self.step_picker = w.Dropdown(description="rollouts of", options=[("latest", LATEST)], value=LATEST)
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

    @property
    def running(self) -> bool:
        """Whether a run started by `start` is going."""
        return self._active

    def start(self, steps: int) -> None:
        """Train `steps` more steps in a background thread: the cell returns and the Stop button stays live.
        Leave the session alone (no other cell calling it) until the run ends (`await dash.wait_async()`)."""
        if self.session is None:
            raise RuntimeError("this dashboard shows a finished run: there is no session to train")
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run started from this dashboard is still going: stop() or wait() first")
        self._target, self._error, self._stopping, self._active = self.session.step_count + steps, None, False, True
        self._update_progress()
        self.status.value = "starting…"
        self.stop_button.disabled = False
        self._thread = threading.Thread(target=self._train, args=(steps,), name="rlbench-dashboard", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> pd.DataFrame:
        """Block until the run started by `start` ends; re-raise its error; return the session's metrics.
        Interrupting it (Ctrl-C, the kernel's interrupt) stops the run after the step in progress."""
        if self._thread is not None:
            try:
                self._thread.join(timeout)
            except KeyboardInterrupt:
                self.stop()
                raise
            if self._thread.is_alive():
                raise TimeoutError(f"the run is still going after {timeout} s")
        return self._result()

    async def wait_async(self, timeout: float | None = None, poll_seconds: float = 0.1) -> pd.DataFrame:
        """`wait()` for a notebook cell, as `await dash.wait_async()`: while it waits, the kernel goes on handling
        widget events (the Stop button), which a blocking `wait()` holds until the run is over. Interrupting the
        cell stops the run after the step in progress."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self._thread is not None and self._thread.is_alive():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout} s")
                await asyncio.sleep(poll_seconds)
        except (KeyboardInterrupt, asyncio.CancelledError):
            self.stop()
            raise
        return self._result()

    def stop(self) -> None:
        """What the Stop button does: end the session's run after the step in progress (nothing if none runs)."""
        if self.session is None or not (self.running or self.session.running):
            return
        self._stopping = self.running
        self.session.request_stop()
        self.stop_button.disabled = True
        self.status.value = "<b>stopping</b> after the step in progress…"

    def refresh(self) -> None:
        """Redraw the curves now (during a run they are redrawn after a step when `refresh_seconds` have
        passed since the last drawing: drawing takes ~0.3 s)."""
        with self._lock:
            rows = len(self._rows)
            self._update_progress()
            self.figure = draw(Figure(), {self.label: pd.DataFrame(self._rows)}, panels=self.panels,
                               smooth=self.smooth)
            self.curves.value = _png(self.figure)
            self._drawn_rows, self._drawn_at = rows, time.perf_counter()
        if self.session is None:
            self.status.value = html.escape(self.summary())
            self.samples.value = "<i>rollouts are kept only while a session runs</i>"

    def summary(self) -> str:
        """One line on the run: how far it got, how it ended, its last reward and accuracy."""
        done, row = len(self._rows), (self._rows[-1] if self._rows else {})
        if self.session is None:
            head = f"finished run {self.label}: {done} steps"
        elif self._error is not None:
            head = f"{self.label}: error after {done} steps: {self._error!r}"
        elif self.running:
            head = f"{self.label}: {done}/{self._target} steps"
        elif self._target is not None:
            ended = f"finished, {done} steps" if done >= self._target else f"stopped after {done}/{self._target} steps"
            head = f"{self.label}: {ended}"
        else:
            head = f"{self.label}: {done} steps"
        return " · ".join([head, *_values(row)])

    def record(self) -> dict:
        """The static record, a mimebundle: the curves as a PNG titled with `summary()`, and the line as text."""
        with self._lock:
            figure = draw(Figure(), {self.label: pd.DataFrame(self._rows)}, panels=self.panels, smooth=self.smooth,
                          title=self.summary())
        return {"image/png": base64.b64encode(_png(figure)).decode(), "text/plain": self.summary()}

    def close(self) -> None:
        """Detach from the session, leave the static record where the panel was shown, and close the widgets."""
        if self.session is not None and self._on_step in self.session.callbacks:
            self.session.callbacks.remove(self._on_step)
        self._leave_record()
        self.widget.close()

    def _ipython_display_(self) -> None:
        """Shown in a notebook: the live panel while a session is attached, else the static record."""
        from IPython.display import display

        if self.session is None:
            display(self.record(), raw=True)
            return
        if self._drawn_rows != len(self._rows):
            self.refresh()
        self._displays.append(display(self.widget, display_id=True))

    # ----------------------------------------------------------------------------- internals
    def _on_step(self, session, row: dict) -> None:
        """The session callback: keep the row and the batch's rollouts, update the labels, maybe redraw."""
        if self._stopping and self.running:  # again: a click may have come before the run began to listen
            session.request_stop()
        with self._lock:
            self._rows.append(row)
            self._keep_rollouts(row["step"], session.last_batch)
            self._update_progress()
            if not self._stopping:
                self.status.value = html.escape(" · ".join(_values(row)))
            if time.perf_counter() - self._drawn_at >= self.refresh_seconds:
                self.refresh()

    def _train(self, steps: int) -> None:
        try:
            self.session.run(steps, progress=False)
        except BaseException as error:  # shown on the dashboard, re-raised by wait()
            self._error = error
        self._active = False
        self.stop_button.disabled = True
        self.refresh()
        self.status.value = html.escape(self.summary())
        self._leave_record()

    def _result(self) -> pd.DataFrame:
        if self._error is not None:
            raise self._error
        return self.session.metrics

    def _leave_record(self) -> None:
        """Replace every displayed copy of the live panel with the static record."""
        if self._displays:
            record = self.record()
            for handle in self._displays:
                handle.update(record, raw=True)
            self._displays.clear()

    def _update_progress(self) -> None:
        done = len(self._rows)
        target = self._target if self._target is not None else done
        self.progress.max = max(target, done, 1)
        self.progress.value = done
        self.progress.description = f"{done}/{target}" if self._target is not None else f"{done} steps"

    def _keep_rollouts(self, step: int, batch) -> None:
        if batch is None:
            return
        self._rollouts.append((step, rollout_table(batch, self.session.tokenizer)))
        chosen = self.step_picker.value
        steps = [s for s, _ in reversed(self._rollouts)]
        self.step_picker.options = [("latest", LATEST)] + [(f"step {s}", s) for s in steps]
        self.step_picker.value = chosen if chosen in steps else LATEST  # a held step stays until it is dropped
        self._show_rollouts()

    def _show_rollouts(self) -> None:
        """The samples of one prompt group of the chosen step: completion, reward, advantage, length."""
        if not self._rollouts:
            return
        step = self.step_picker.value
        table = self._rollouts[-1][1] if step == LATEST else dict(self._rollouts).get(step)
        if table is None:
            return
        groups = sorted(table["group"].unique())
        self.group_picker.max = len(groups) - 1
        group = table[table["group"] == groups[min(self.group_picker.value, len(groups) - 1)]]
        shown = group.drop(columns=["group", "prompt"]).assign(
            completion=[_short(c, self.max_chars) for c in group["completion"]])
        prompt = html.escape(_short(group["prompt"].iloc[0], self.max_chars))
        step_label = f"step {self._rollouts[-1][0] if step == LATEST else step}"
        head = f"<p><b>{step_label}, prompt</b> {prompt} ({len(group)} samples)</p>"
        self.samples.value = head + shown.to_html(index=False, float_format=lambda v: f"{v:.3g}", border=0,
                                                  classes="rlbench-table") + TABLE_STYLE


TABLE_STYLE = ("<style>.rlbench-table{border-collapse:collapse;font-size:12px}"
               ".rlbench-table th,.rlbench-table td{padding:2px 8px;text-align:right;border:none}"
               ".rlbench-table thead{border-bottom:1px solid #bbb}"
               ".rlbench-table tbody tr:nth-child(odd){background:#f5f5f5}</style>")
"""The rollout browser's table in the look of a notebook's DataFrame (a widget's HTML gets no notebook styles)."""


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def _values(row: dict) -> list[str]:
    return [f"{name} {row[name]:.3g}" for name in ("reward_mean", "accuracy", "time_step") if name in row]


def _short(text, max_chars: int) -> str:
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


__all__ = ["LATEST", "PANELS", "TIMINGS", "Dashboard", "Panel", "draw", "load_metrics", "plot", "plot_sample", "rollout_table"]
