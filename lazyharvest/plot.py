"""Plots of reaped values (the optional `[plot]` extra: matplotlib).

matplotlib is imported inside the functions, so `import lazyharvest` and
`import lazyharvest.plot` never import it. Figures are made with
`matplotlib.figure.Figure`, not pyplot: no window opens, no figure is kept
alive by pyplot, and saving renders with Agg whatever the backend. In a
notebook the returned Figure displays itself; in a script, pass `path=`, or
an `ax` from `plt.subplots()` to show it in a window.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest import keys as keys_mod
from lazyharvest.display import Entry, entries

_DIFF_LABELS = ("vjp", "jvp")


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "lazyharvest.plot needs matplotlib: pip install 'lazyharvest[plot]'"
        ) from e
    return Figure


def _inexact(e: Entry) -> bool:
    return all(jnp.issubdtype(p.dtype, jnp.inexact) for p in e.parts)


def _select(d: Any, keys: Sequence[Any] | None) -> list[Entry]:
    es = entries(d)
    if keys is None:
        chosen = [e for e in es if _inexact(e) and e.labels[:1] and
                  e.labels[0] in _DIFF_LABELS]
        return chosen or [e for e in es if _inexact(e)]
    chosen = []
    for key in keys:
        k = keys_mod.normalize(key)
        hits = [e for e in es
                if any(a[:len(k)] == k for a in (e.key, *e.aliases))]
        if not hits:
            raise d._unknown(k)
        chosen += hits
    for e in chosen:
        if not _inexact(e):
            raise ValueError(f"site_norms: {keys_mod.display(e.key)!r} is not a "
                             f"floating array, it has no norm to plot")
    return list({e.key: e for e in chosen}.values())


def _norm(e: Entry) -> float:
    total = 0.0
    for p in e.parts:
        if _jax.is_tracer(p.value):
            raise TypeError("lazyharvest.plot: cannot plot traced values; call it "
                            "outside jit/vmap/grad, on a DelayedDict made there")
        if not getattr(p.value, "is_fully_addressable", True):
            # spread over processes: a global reduction every process runs
            total += float(jnp.sum(jnp.abs(p.value).astype(jnp.float32) ** 2))
            continue
        v = np.abs(np.asarray(p.value)).astype(np.float64)
        total += float(np.sum(v * v))
    return float(np.sqrt(total))


def site_norms(d: Any, keys: Sequence[Any] | None = None, ax: Any = None,
               path: str | os.PathLike | None = None, *, log: bool = False) -> Any:
    """Bar chart of each site's L2 norm, sites in program order: which layer matters.

    The chosen leaves are forced in one program (`d.compute(...)`).

    Arguments:
      d: a `DelayedDict`.
      keys: the keys (or key prefixes) to plot. Default: the tangent and
        cotangent leaves (keys starting with "vjp" or "jvp"), or every
        floating leaf when there are none.
      ax: a matplotlib Axes to draw into; default a new Figure.
      path: when given, the figure is saved there (PNG unless the suffix
        names another format).
      log: a logarithmic y axis, for norms spanning orders of magnitude.
    Returns:
      the matplotlib `Figure`.

    Example: `plot.site_norms(lh.reap(jax.grad(loss), tag="act")(p, x), path="n.png")`.
    """
    Figure = _figure_class()
    chosen = _select(d, keys)
    if not chosen:
        raise ValueError("site_norms: no floating leaf to plot")
    d.compute(*(e.key for e in chosen))
    done = {e.key: e for e in entries(d)}
    chosen = sorted((done[e.key] for e in chosen), key=lambda e: e.site_index)
    sites = list(dict.fromkeys(e.site for e in chosen))
    series = list(dict.fromkeys(e.labels for e in chosen))
    if ax is None:
        fig = Figure(figsize=(max(4.0, 0.5 * len(sites) + 2), 3.5), layout="constrained")
        ax = fig.subplots()
    fig = ax.figure
    width = 0.8 / len(series)
    for j, labels in enumerate(series):
        xs, ys = zip(*((sites.index(e.site), _norm(e)) for e in chosen
                       if e.labels == labels))
        ax.bar(np.array(xs) + (j - (len(series) - 1) / 2) * width, ys, width,
               label="/".join(map(str, labels)) or "value")
    tilt = len(sites) > 6  # long runs of layer names overlap when upright
    ax.set_xticks(range(len(sites)), ["/".join(map(str, s)) for s in sites],
                  rotation=45 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylabel("L2 norm")
    ax.set_title("norm per site")
    if log:
        ax.set_yscale("log")
    if len(series) > 1 or series[0]:
        ax.legend()
    if path is not None:
        fig.savefig(path)
    return fig


def attention_grid(value: Any, path: str | os.PathLike | None = None, *, batch: int = 0,
                   layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, cmap: str = "viridis",
                   title: str | None = None) -> Any:
    """A grid of attention maps, one row per layer and one column per head.

    Arguments:
      value: an `append` site's value, shaped (layers, heads, T, S) or
        (layers, batch, heads, T, S), e.g. `d["attn"]`.
      path: when given, the figure is saved there (PNG unless the suffix
        names another format).
      batch: the batch element shown for a 5-dimensional value.
      layers, heads: the indices to show (default all).
      cmap: a matplotlib colormap; one color scale is shared by every map.
      title: the figure's title.
    Returns:
      the matplotlib `Figure`.

    Example: `plot.attention_grid(d["attn"], path="attn.png", heads=[0, 1])`.
    """
    Figure = _figure_class()
    if _jax.is_tracer(value):
        raise TypeError("attention_grid: cannot plot a traced value; call it "
                        "outside jit/vmap/grad")
    a = np.asarray(value).astype(np.float32)
    if a.ndim == 5:
        a = a[:, batch]
    if a.ndim != 4:
        raise ValueError("attention_grid: expected a value shaped (layers, heads, T, S) "
                         f"or (layers, batch, heads, T, S), got {np.shape(value)}")
    rows = list(range(a.shape[0])) if layers is None else list(layers)
    cols = list(range(a.shape[1])) if heads is None else list(heads)
    fig = Figure(figsize=(1.6 * len(cols) + 1.2, 1.6 * len(rows) + 0.6),
                 layout="constrained")
    axes = fig.subplots(len(rows), len(cols), squeeze=False)
    lo, hi = float(np.min(a[rows][:, cols])), float(np.max(a[rows][:, cols]))
    for i, layer in enumerate(rows):
        for j, head in enumerate(cols):
            im = axes[i, j].imshow(a[layer, head], cmap=cmap, vmin=lo, vmax=hi,
                                   interpolation="nearest")
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
            if i == 0:
                axes[i, j].set_title(f"head {head}", fontsize=9)
            if j == 0:
                axes[i, j].set_ylabel(f"layer {layer}", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8)
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path)
    return fig
