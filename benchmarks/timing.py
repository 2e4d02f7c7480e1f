"""What the benchmark scripts share: the median wall time of repeated calls."""

from __future__ import annotations

import statistics
import time


def timed(function, rounds: int) -> tuple[float, object]:
    """The median wall time of ``rounds`` calls after one uncounted call (a first call's one-time costs), and the
    last call's result."""
    function()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
