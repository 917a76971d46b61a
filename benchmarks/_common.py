"""Shared helpers for the benchmark scripts (timing, checking, tables).

Not a benchmark itself. Every script imports it as `_common`: it lives next to
them, and `python benchmarks/<name>.py` puts this folder on `sys.path`.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# Keep the run short and comparable on a small CPU machine.
RTOL = 1e-5
ATOL = 1e-5


def _library_version() -> str:
    """Where lazyharvest was imported from, and its git commit if any."""
    import lazyharvest
    where = os.path.dirname(os.path.abspath(lazyharvest.__file__))
    try:
        root = os.path.dirname(where)
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--",
                                "lazyharvest"], capture_output=True, text=True,
                               timeout=10)
        if commit.returncode == 0:
            extra = " + uncommitted changes" if dirty.stdout.strip() else ""
            return f"{where} @ {commit.stdout.strip()}{extra}"
    except (OSError, subprocess.SubprocessError):
        pass
    return where


def header(title: str) -> None:
    dev = jax.devices()[0]
    print("=" * 78)
    print(title)
    print(f"jax {jax.__version__} | backend {jax.default_backend()} | device "
          f"{dev.device_kind} x{jax.device_count()} | {os.cpu_count()} CPU cores | "
          f"python {platform.python_version()}")
    print(f"lazyharvest {_library_version()}")
    print("=" * 78)


def block(x: Any) -> Any:
    """Waits for every array in the pytree `x`."""
    return jax.block_until_ready(x)


def check_close(got: Any, want: Any, what: str) -> None:
    """Asserts the lazyharvest value equals the hand-written one (pytrees)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"{what}: structure {got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL,
                                   atol=ATOL, err_msg=what)


def time_interleaved(fns: dict[str, Callable[[], Any]], *, number: int,
                     repeat: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each zero-argument `fn`.

    Each `fn` must block on its result. The repeats of the candidates are
    interleaved (A B A B ...), so slow drift of the machine (frequency, other
    load) hits them alike. Returns the median over `repeat` of the mean over
    `number` calls.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                samples[name].append((time.perf_counter() - t0) / number)
    finally:
        if gc_was:
            gc.enable()
    return {k: statistics.median(v) for k, v in samples.items()}


def time_once_median(fns: dict[str, Callable[[], Any]], *, repeat: int
                     ) -> dict[str, float]:
    """Median seconds of single calls, interleaved; for one-off work (compiles)."""
    return time_interleaved(fns, number=1, repeat=repeat, warmup=0)


class CompileCounter:
    """Counts XLA compilations (jax.monitoring), to check what a timing covers."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == self.EVENT:
            self.count += 1


def flag(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "ABOVE"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints a plain right-aligned text table (first column left-aligned)."""
    cells = [[str(c) for c in columns]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))
    print()


def summary(results: list[tuple[str, float, float]]) -> None:
    """`results`: (what, ratio, target). Prints the ABOVE lines, if any."""
    above = [(w, r, t) for w, r, t in results if r > t]
    if not above:
        print(f"all {len(results)} ratios within target")
    else:
        print(f"{len(above)} of {len(results)} ratios above target:")
        for w, r, t in above:
            print(f"  ABOVE  {w}: {r:.2f}x > {t:.2f}x")
    sys.stdout.flush()
