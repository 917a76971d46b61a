"""Notebook display of a `DelayedDict`: an HTML tree and a summary table.

Nothing here forces a pending leaf, except `summary(d, compute=True)`, which
forces them all in one program first. Statistics are computed on the host
with numpy from leaves that are already computed, so displaying compiles
nothing. The functions take a `DelayedDict` but this module does not import
`lazyharvest.delayed` (which imports this module lazily), so there is no
import cycle.
"""

from __future__ import annotations

import dataclasses
import functools
import html
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyharvest import _jax
from lazyharvest import keys as keys_mod

# "auto": treescope when it is installed, else plain HTML; or "treescope", "plain".
HTML_BACKEND = "auto"
# Trees with more leaves than this open only their first level.
OPEN_ALL_UP_TO = 64

_BARS = " ▁▂▃▄▅▆▇█"
_GREY, _GREEN, _RED = "#888", "#2a7a2a", "#b22"


# -- what a DelayedDict holds, without forcing anything ------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Part:
    """One array of a leaf (a leaf is a pytree of arrays, usually just one)."""

    path: str  # `jax.tree_util.keystr` inside the leaf; '' for an array leaf
    shape: tuple
    dtype: Any
    computed: bool
    value: Any  # the array when computed, else None

    @functools.cached_property
    def stats(self) -> Stats | str | None:
        """`describe(value)` once (a page sizes its columns and then draws
        them from it); None for a pending array."""
        return describe(self.value) if self.computed else None


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Entry:
    """One leaf of a DelayedDict, shown once under its shortest key."""

    key: tuple  # canonical key, relative to the view
    aliases: tuple  # the other keys of the same leaf
    labels: tuple  # the key's transformation labels: key minus scopes and name
    site: tuple  # (*scopes, name)
    site_index: int  # first appearance of `site` among the program's sites
    parts: tuple

    @property
    def computed(self) -> bool:
        return all(p.computed for p in self.parts)


def entries(d: Any) -> list[Entry]:
    """The leaves of `d` in site order, with values for the computed ones."""
    store = d._store
    sites = store.traced.sites
    values = dict(store.values)  # a snapshot: another thread may be forcing
    first: dict = {}
    for scopes, name in ((r[1], r[2]) for r in sites):
        first.setdefault((*scopes, name), len(first))
    by_raw: dict = {}
    for k, r in d._leaves.items():
        by_raw.setdefault(r, []).append(k)
    out = []
    for raw, ks in by_raw.items():
        ks = sorted(ks, key=len)  # stable: the first shortest, as `keys()` shows
        site = (*raw[1], raw[2])
        n_labels = max(len(ks[0]) - len(site), 0)
        out.append(Entry(ks[0], tuple(ks[1:]), ks[0][:n_labels], site,
                         first.get(site, len(first)),
                         _parts(sites[raw], values.get(raw, _MISSING), raw in values)))
    return out


_MISSING = object()


def _parts(site: Any, value: Any, computed: bool) -> tuple:
    index_tree = jax.tree_util.tree_unflatten(site.tree, list(range(len(site.avals))))
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(index_tree)[0]]
    arrays = jax.tree_util.tree_leaves(value) if computed else [None] * len(paths)
    return tuple(Part(path, tuple(a.shape), a.dtype, computed, x)
                 for path, a, x in zip(paths, site.avals, arrays))


def key_text(key: tuple) -> str:
    """A key as `keys()` shows it: `h0` or `('vjp', 'h0')`."""
    shown = keys_mod.display(key)
    return shown if isinstance(shown, str) else repr(shown)


# -- statistics of a computed array --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stats:
    """Host-side statistics of one computed array (of |z| for complex ones).

    mean, std, min and max are over the finite values; `l2` and `max_abs`
    are over all values and given for floating and complex arrays only.
    """

    size: int
    mean: float
    std: float
    min: float
    max: float
    l2: float | None
    max_abs: float | None
    nonfinite: int
    hist: str


def describe(x: Any) -> Stats | str:
    """`Stats` of a computed array, or a short note saying why there are none.

    Arguments:
      x: a computed leaf array (a tracer inside a trace gives `"traced"`).
    Returns:
      `Stats`, or a note: `"traced"`, `"PRNG key"`, `"empty"`, ...

    Example: `describe(jnp.arange(4.)).mean == 1.5`.
    """
    if _jax.is_tracer(x):
        return "traced"
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "PRNG key"
    if not getattr(x, "is_fully_addressable", True):
        return "not addressable"
    a = np.asarray(x)
    if a.size == 0:
        return "empty"
    inexact = jnp.issubdtype(a.dtype, jnp.inexact)
    if not (inexact or jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == np.bool_):
        return str(a.dtype)  # float0 and other dtypes without arithmetic
    return _stats(a, inexact)


def _stats(a: np.ndarray, inexact: bool) -> Stats:
    v = (np.abs(a) if np.iscomplexobj(a) else a).astype(np.float64).ravel()
    finite = np.isfinite(v)
    fin = v if finite.all() else v[finite]
    nan = float("nan")
    mean, std, lo, hi = ((float(fin.mean()), float(fin.std()), float(np.min(fin)),
                          float(np.max(fin))) if fin.size else (nan,) * 4)
    return Stats(
        size=int(v.size), mean=mean, std=std, min=lo, max=hi,
        l2=float(np.sqrt(np.sum(v * v))) if inexact else None,
        max_abs=float(np.max(np.abs(v))) if inexact else None,
        nonfinite=int(v.size - fin.size), hist=sparkline(fin))


def sparkline(values: np.ndarray, bins: int = 16) -> str:
    """A histogram of `values` as `bins` unicode block characters.

    Empty bins are spaces; any non-empty bin is at least one eighth high, so
    outliers stay visible. Fewer values than bins give one bin per value;
    fewer than two values give ''.
    """
    if values.size < 2:
        return ""
    if values.min() == values.max():
        return _BARS[-1]  # numpy would widen the range and draw an off-centre bar
    counts, _ = np.histogram(values, bins=min(bins, values.size))
    top = counts.max()
    levels = np.where(counts > 0, np.ceil(counts / top * 8), 0).astype(int)
    return "".join(_BARS[n] for n in levels)


def _num(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}g}"


# -- HTML ------------------------------------------------------------------------


def to_html(d: Any, backend: str | None = None) -> str:
    """HTML for a DelayedDict; forces nothing.

    Arguments:
      d: a `DelayedDict` (or a sub-view).
      backend: "treescope", "plain", or "auto" (treescope when installed);
        `None` reads the module's `HTML_BACKEND`.
    Returns:
      an HTML fragment: a collapsible tree of keys, each leaf with shape,
      dtype, computed/pending and, when computed, mean/std/min/max and a
      histogram.

    Example: `IPython.display.HTML(to_html(d, backend="plain"))`.
    """
    backend = backend or HTML_BACKEND
    if backend not in ("auto", "plain", "treescope"):
        raise ValueError(f"backend must be 'auto', 'plain' or 'treescope', got {backend!r}")
    if backend != "plain":
        try:
            import treescope  # noqa: F401  (optional: the [treescope] extra)
        except ImportError:
            if backend == "treescope":
                raise ImportError("the treescope backend needs treescope: "
                                  "pip install 'lazyharvest[treescope]'") from None
        else:
            return _treescope_html(d)
    return _plain_html(d)


def _header(d: Any, es: Sequence[Entry]) -> str:
    done = sum(e.computed for e in es)
    view = f" · view {key_text(d._prefix)}" if d._prefix else ""
    return (f'<div class="lh-header"><b>DelayedDict</b> · tag '
            f'{html.escape(repr(d._store.traced.harvest.tag))}{html.escape(view)} · '
            f'{len(es)} {"leaf" if len(es) == 1 else "leaves"}: {done} computed, '
            f'{len(es) - done} pending</div>')


@dataclasses.dataclass
class _Node:
    entry: Entry | None = None
    children: dict = dataclasses.field(default_factory=dict)


def _nest(es: Sequence[Entry]) -> _Node:
    root = _Node()
    for e in es:
        node = root
        for part in e.key:
            node = node.children.setdefault(part, _Node())
        node.entry = e
    return root


def _plain_html(d: Any) -> str:
    es = entries(d)
    root = _nest(es)
    widths = _Widths.of(root)
    body = _children_html(root, 0, len(es) <= OPEN_ALL_UP_TO, widths)
    return ('<div class="lh-delayed" style="font-family:monospace;font-size:13px;'
            f'line-height:1.6">{_header(d, es)}{body}</div>')


_INDENT = 3  # ch per level of nesting (a node's triangle and a space fit in it)
_STATS = ("mean", "std", "min", "max")


@dataclasses.dataclass(frozen=True)
class _Widths:
    """Column widths in `ch` (the monospace font's character width), so that
    every row's columns start at the same place whatever its depth or
    values: the name column shrinks by the indent of its level."""

    name: int
    shape: int
    dtype: int
    stats: dict

    @classmethod
    def of(cls, root: _Node) -> _Widths:
        names, shapes, dtypes = [1], [1], [1]
        stats: dict = {k: 1 for k in _STATS}

        def visit(node: _Node, depth: int) -> None:
            for part, child in node.children.items():
                if child.entry is not None:
                    e = child.entry
                    names.append(len(str(part)) + _INDENT * depth)
                    for p in e.parts:
                        if p.path:
                            names.append(len(p.path) + _INDENT * (depth + 1))
                        shapes.append(len(str(p.shape)))
                        dtypes.append(len(str(p.dtype)))
                        summary = p.stats
                        if summary is not None and not isinstance(summary, str):
                            for k in _STATS:
                                stats[k] = max(stats[k], len(f"{k} {_num(getattr(summary, k))}"))
                visit(child, depth + 1)
        visit(root, 0)
        return cls(max(names), max(shapes), max(dtypes), stats)


def _children_html(node: _Node, depth: int, open_all: bool, widths: _Widths) -> str:
    out = []
    for part, child in node.children.items():
        name = html.escape(str(part))
        if child.entry is not None:
            out.append(_leaf_html(name, child.entry, depth, widths))
        if child.children:
            n = sum(1 for _ in _walk(child))
            opened = " open" if open_all or depth == 0 else ""
            out.append(
                f'<details class="lh-node" data-part="{name}"{opened}>'
                f'<summary><b>{name}</b> <span style="color:{_GREY}">({n})</span>'
                f'</summary><div style="padding-left:{_INDENT}ch">'
                f'{_children_html(child, depth + 1, open_all, widths)}</div></details>')
    return "".join(out)


def _walk(node: _Node) -> Iterator[Entry]:
    for child in node.children.values():
        if child.entry is not None:
            yield child.entry
        yield from _walk(child)


def _leaf_html(name: str, e: Entry, depth: int, widths: _Widths) -> str:
    state = "computed" if e.computed else "pending"
    keys = ", ".join(key_text(k) for k in (e.key, *e.aliases))
    attrs = (f'data-key="{html.escape(key_text(e.key))}" data-state="{state}" '
             f'title="{html.escape("keys: " + keys)}"')
    name_width = widths.name - _INDENT * depth
    label = f'<span class="lh-name" style="{_cell(name_width)}font-weight:bold">{name}</span>'
    if len(e.parts) == 1 and not e.parts[0].path:
        return f'<div class="lh-leaf" {attrs}>{label}{_part_html(e.parts[0], widths)}</div>'
    rows = "".join(
        f'<div class="lh-part" data-part="{html.escape(p.path)}" '
        f'style="padding-left:{_INDENT}ch"><span class="lh-name" '
        f'style="{_cell(name_width - _INDENT)}">{html.escape(p.path)}</span>'
        f'{_part_html(p, widths)}</div>'
        for p in e.parts)
    return (f'<details class="lh-leaf" {attrs} open><summary>{label}'
            f'<span style="color:{_GREY}">pytree of {len(e.parts)} arrays · {state}'
            f'</span></summary>{rows}</details>')


def _cell(ch: int) -> str:
    # (one space of padding after the column's widest content)
    return f"display:inline-block;width:{ch + 1}ch;white-space:pre;"


def _part_html(p: Part, widths: _Widths) -> str:
    shape = html.escape(str(p.shape))
    dtype = html.escape(str(p.dtype))
    color = _GREEN if p.computed else _GREY
    out = (f'<span class="lh-shape" style="{_cell(widths.shape)}">{shape}</span>'
           f'<span class="lh-dtype" style="{_cell(widths.dtype)}">{dtype}</span>'
           f'<span class="lh-state" style="{_cell(len("computed"))}color:{color}">'
           f'{"computed" if p.computed else "pending"}</span>')
    s = p.stats
    if s is None:  # pending
        return out
    if isinstance(s, str):
        return out + f'<span class="lh-note" style="color:{_GREY}">{html.escape(s)}</span>'
    for stat in _STATS if s.nonfinite < s.size else ():
        out += (f'<span class="lh-stat" data-stat="{stat}" style="{_cell(widths.stats[stat])}">'
                f'{stat} {_num(getattr(s, stat))}</span>')
    if s.nonfinite:
        out += (f'<span class="lh-stat" data-stat="nonfinite" style="color:{_RED};'
                f'padding-right:0.8em">nan/inf {s.nonfinite}</span>')
    if s.hist:
        out += (f'<span class="lh-hist" title="histogram of the finite values, '
                f'{_num(s.min)} to {_num(s.max)}" style="white-space:pre;'
                f'background:#eee;color:#357">{html.escape(s.hist)}</span>')
    return out


class Pending:
    """Stands for a pending leaf in the treescope rendering."""

    def __init__(self, shape: tuple, dtype: str):
        self.shape = shape
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"<pending {self.dtype}{list(self.shape)}>"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import repr_lib
        return repr_lib.render_object_constructor(
            type(self), {"shape": self.shape, "dtype": self.dtype}, path,
            subtree_renderer)


def _treescope_html(d: Any) -> str:
    import treescope

    es = entries(d)
    sites = d._store.traced.sites
    tree: dict = {}
    for e in es:
        node = tree
        for part in e.key[:-1]:
            node = node.setdefault(part, {})
        raw = d._leaves[e.key]
        node[e.key[-1]] = (d._store.values[raw] if e.computed else
                           jax.tree_util.tree_unflatten(
                               sites[raw].tree,
                               [Pending(p.shape, str(p.dtype)) for p in e.parts]))
    try:
        # (uncompressed: treescope inserts compressed content only once the
        # output has been scrolled into view and decompressed asynchronously,
        # so a page, a screenshot or a static notebook export shows
        # "(Loading...)" until then)
        body = treescope.render_to_html(tree, ignore_exceptions=True, compressed=False)
    except Exception:  # a treescope bug must not hide the DelayedDict
        return _plain_html(d)
    return f'<div class="lh-delayed">{_header(d, es)}{body}</div>'


# -- summary table -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One array of one leaf in a `SummaryTable`."""

    key: str  # as `keys()` shows it, plus the pytree path inside the leaf
    shape: tuple
    dtype: str
    state: str  # "computed" or "pending"
    l2: float | None  # computed floating (and complex) arrays only
    max_abs: float | None
    note: str  # why l2 is absent from a computed array ("traced", "int32"...)


class SummaryTable:
    """Rows of key, shape, dtype, state, L2 norm and max |x|.

    `str(table)` is an aligned text table; in a notebook it renders as an
    HTML table. `table.rows` holds the `SummaryRow`s.
    """

    COLUMNS = ("key", "shape", "dtype", "state", "l2 norm", "max |x|")

    def __init__(self, rows: Sequence[SummaryRow]):
        self.rows = tuple(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[SummaryRow]:
        return iter(self.rows)

    def _cells(self) -> list[list[str]]:
        return [[r.key, str(r.shape), r.dtype, r.state,
                 _num(r.l2, 6) if r.l2 is not None else r.note, _num(r.max_abs, 6)]
                for r in self.rows]

    def __str__(self) -> str:
        cells = [list(self.COLUMNS), *self._cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.COLUMNS))]
        def line(row: list[str]) -> str:
            return "  ".join(c.rjust(w) if i >= 4 else c.ljust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join(
            "<tr>" + "".join(
                f'<td style="text-align:{"right" if i >= 4 else "left"}">'
                f"{html.escape(c)}</td>" for i, c in enumerate(row)) + "</tr>"
            for row in self._cells())
        return (f'<table class="lh-summary" style="font-family:monospace">'
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def summary(d: Any, compute: bool = False) -> SummaryTable:
    """The `SummaryTable` of `d`; see `DelayedDict.summary`."""
    if compute:
        d.compute()  # one program for every leaf
    rows = []
    for e in entries(d):
        for p in e.parts:
            s = p.stats
            note = s if isinstance(s, str) else ""  # integers and bools: no note
            rows.append(SummaryRow(
                key_text(e.key) + p.path, p.shape, str(p.dtype),
                "computed" if p.computed else "pending",
                s.l2 if isinstance(s, Stats) else None,
                s.max_abs if isinstance(s, Stats) else None, note))
    return SummaryTable(rows)
