"""Shared by the benchmark scripts (they run from this folder, so `from timing import ...` finds it)."""

import statistics
import time


def tokens_per_second(fn, repeats: int) -> float:
    """Median of `fn()`'s returned token count over its wall time, after one warm-up call."""
    fn()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = int(fn())
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)
