"""Which differences between runs are real: means over seeds with percentile-bootstrap intervals, differences
against a baseline, and the summaries of a learning curve (final value, area under it, value at a token budget).

The bootstrap (Efron's percentile interval): resample an arm's per-seed values with replacement (as many as it
has), take the mean of each resample, and report the `level` central interval of those means. A difference of two
arms resamples each arm's seeds independently and takes the difference of the two means. A quantile is the
smallest resampled value with at least that share of resamples at or below it (numpy's "inverted_cdf"). With few
seeds (n^n resamples, or the product of both arms' counts for a difference, at most `resamples`) every resample is
enumerated, each equally likely: the interval is then exact, not a Monte Carlo estimate. Otherwise `resamples`
draws come from `np.random.default_rng(seed)`, so the same table gives the same intervals. With two or three seeds
an interval is wide and says little: with n seeds it spans the values the seeds' means can take.

Pure numpy and pandas; imports nothing of rlbench.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

RESAMPLES = 10_000
"""Bootstrap resamples (Monte Carlo), and the most resamples enumerated exactly."""
LEVEL = 0.95
"""Central probability of every interval."""


def resample_means(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The bootstrap distribution of the mean of `values`: every one of the n^n equally likely resamples'
    means when there are at most `resamples`, else `resamples` means drawn by a seeded generator."""
    x_N = np.asarray(values, dtype=float)
    n = len(x_N)
    if n == 0:
        raise ValueError("no values to resample")
    if n**n <= resamples:
        index_R_N = np.array(list(itertools.product(range(n), repeat=n)))  # [n^n, n]: every resample
    else:
        index_R_N = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return x_N[index_R_N].mean(axis=1)


def interval(means_R: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval: the (1 - level) / 2 and (1 + level) / 2 quantiles of resampled statistics, each
    the smallest value whose share of resamples at or below it reaches that probability (`inverted_cdf`: the
    quantile of the enumerated distribution itself, which Monte Carlo draws approach)."""
    lo, hi = np.quantile(means_R, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(lo), float(hi)


def mean_ci(values: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL,
            seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of `values` (one per seed) and its percentile-bootstrap interval."""
    return (float(np.mean(values)),
            *interval(resample_means(values, resamples=resamples, seed=seed), level))


def difference_ci(values: Sequence[float], baseline: Sequence[float], *, resamples: int = RESAMPLES,
                  level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """(mean(values) - mean(baseline), lo, hi), each arm's seeds resampled independently: every pair of the
    two arms' resamples when there are at most `resamples` pairs, else `resamples` draws of each."""
    n, m = len(values), len(baseline)
    if n**n * m**m <= resamples:
        a_R, b_S = resample_means(values, resamples=n**n), resample_means(baseline, resamples=m**m)
        diffs = (a_R[:, None] - b_S[None, :]).ravel()  # [n^n * m^m]: every pair, equally likely
    else:
        rng = np.random.default_rng(seed)
        a_N, b_M = np.asarray(values, dtype=float), np.asarray(baseline, dtype=float)
        diffs = (a_N[rng.integers(0, n, size=(resamples, n))].mean(1)
                 - b_M[rng.integers(0, m, size=(resamples, m))].mean(1))
    return (float(np.mean(values) - np.mean(baseline)), *interval(diffs, level))


def auc(x: Sequence[float], y: Sequence[float]) -> float:
    """The area under the curve y(x) by the trapezoid rule, divided by the span of x: the curve's mean height
    (a constant curve's AUC is that constant). A curve of one point is its value."""
    x_N, y_N = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x_N) == 1:
        return float(y_N[0])
    return float(np.sum((x_N[1:] - x_N[:-1]) * (y_N[1:] + y_N[:-1]) / 2) / (x_N[-1] - x_N[0]))


def value_at(x: Sequence[float], y: Sequence[float], at: float) -> float:
    """y at x = `at`, linearly interpolated between the two nearest points (e.g. accuracy at a token budget); NaN
    past the curve's last point (the run never got there)."""
    x_N = np.asarray(x, dtype=float)
    return float(np.interp(at, x_N, np.asarray(y, dtype=float))) if at <= x_N[-1] else float("nan")


def run_summaries(table: pd.DataFrame, *, metric: str = "greedy_accuracy", x: str = "step", tokens: str = "tokens",
                  budget: float | None = None) -> pd.DataFrame:
    """One row per run (`run_id`) of a learning-curve table (one row per run and evaluation point): its `final`
    value of `metric`, `auc` (over `x`, normalised by its span) and `at_budget` (at `budget` tokens; default: the
    fewest any run generated, so every run reaches it), with the run's other columns (its settings)."""
    budget = budget if budget is not None else float(table.groupby("run_id")[tokens].max().min())
    rows = []
    for _, curve in table.groupby("run_id", sort=False):  # runs in the table's order
        curve = curve.sort_values(x)
        last = curve.iloc[-1]
        rows.append(last.to_dict() | {"final": float(last[metric]), "auc": auc(curve[x], curve[metric]),
                                      "at_budget": value_at(curve[tokens], curve[metric], budget), "budget": budget})
    return pd.DataFrame(rows)


def summarize(runs: pd.DataFrame, by: Sequence[str], *, columns: Sequence[str] = ("final", "auc", "at_budget"),
              **bootstrap) -> pd.DataFrame:
    """One row per arm (the values of `by`): for each column, its mean over the arm's runs (`COL`), the interval
    (`COL_lo`, `COL_hi`) and the runs counted (`n`). `bootstrap`: `resamples`, `level`, `seed` of `mean_ci`."""
    rows = []
    for key, arm in runs.groupby(list(by), sort=False, dropna=False):
        row = dict(zip(by, key if isinstance(key, tuple) else (key,))) | {"n": len(arm)}
        for column in columns:
            row[column], row[f"{column}_lo"], row[f"{column}_hi"] = mean_ci(arm[column].dropna(), **bootstrap)
        rows.append(row)
    return pd.DataFrame(rows)


def compare(runs: pd.DataFrame, by: Sequence[str], baseline: dict, *,
            columns: Sequence[str] = ("final", "auc", "at_budget"), **bootstrap) -> pd.DataFrame:
    """Each arm (the values of `by`) against its baseline: the arm with the `baseline` settings put in (e.g.
    {"algorithm": "grpo"}: dapo at lr 3e-4 against grpo at lr 3e-4). Per column: the difference of means
    (`COL_diff`), its interval (`_lo`, `_hi`) and `COL_real` (0 lies outside the interval). Arms without a
    baseline arm, and the baseline arms themselves, are left out."""
    rows = []
    arms = {key if isinstance(key, tuple) else (key,): arm for key, arm in runs.groupby(list(by), sort=False, dropna=False)}
    for key, arm in arms.items():
        settings = dict(zip(by, key))
        reference = tuple((settings | baseline)[k] for k in by)
        if reference == key or reference not in arms:
            continue
        row = settings | {"n": len(arm), "n_baseline": len(arms[reference])}
        for column in columns:
            diff, lo, hi = difference_ci(arm[column].dropna(), arms[reference][column].dropna(), **bootstrap)
            row |= {f"{column}_diff": diff, f"{column}_lo": lo, f"{column}_hi": hi, f"{column}_real": lo > 0 or hi < 0}
        rows.append(row)
    names = [f"{column}_{part}" for column in columns for part in ("diff", "lo", "hi", "real")]
    return pd.DataFrame(rows, columns=[*by, "n", "n_baseline", *names])


def curve_bands(table: pd.DataFrame, by: Sequence[str], *, metric: str = "greedy_accuracy", x: str = "step",
                **bootstrap) -> pd.DataFrame:
    """Learning curves of each arm: at every `x` its runs share, the mean of `metric` over them and its interval
    (`mean`, `lo`, `hi`), for plotting a line and a band."""
    rows = []
    for key, points in table.groupby([*by, x], sort=True, dropna=False):
        mean, lo, hi = mean_ci(points[metric].dropna(), **bootstrap)
        rows.append(dict(zip([*by, x], key)) | {"mean": mean, "lo": lo, "hi": hi, "n": len(points)})
    return pd.DataFrame(rows)
