"""Notebook display: the HTML repr, `summary` and the plot helpers."""

import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyharvest as lh
from helpers import CompileCounter
from lazyharvest import display

sow = lh.sow
COMPILES = CompileCounter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

W0 = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (3, 4)), np.float32)
W1 = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (4, 2)), np.float32)
X = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)


def make_loss():
    """A fresh 2-layer MLP (fresh, so no earlier test compiled its programs)."""
    def loss(w0, w1, x):
        h0 = sow(jnp.tanh(x @ w0), tag="act", name="h0")
        h1 = lh.nest(lambda h: sow(jnp.tanh(h @ w1), tag="act", name="h1"),
                     scope="block")(h0)
        return jnp.sum(h1 ** 2)
    return loss


def numpy_leaves():
    """Every leaf of `reap(grad(loss))`, by hand in numpy."""
    h0 = np.tanh(X @ W0)
    h1 = np.tanh(h0 @ W1)
    g1 = 2 * h1
    g0 = (g1 * (1 - h1 ** 2)) @ W1.T
    return {"h0": h0, "('block', 'h1')": h1, "('vjp', 'h0')": g0,
            "('vjp', 'block', 'h1')": g1}


def reaped(loss=None):
    return lh.reap(jax.grad(loss or make_loss()), tag="act")(W0, W1, X)


def partly_computed():
    d = reaped()
    d["vjp", "h0"]
    d["block", "h1"]
    return d


class Leaves(HTMLParser):
    """Collects the `lh-leaf` elements: their attributes, fields and ancestors."""

    def __init__(self):
        super().__init__()
        self.stack, self.leaves, self.groups, self.tags = [], [], [], []
        self.leaf = self.field = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "")
        self.tags.append(tag)
        self.stack.append((tag, cls, a))
        if cls == "lh-node":
            self.groups.append(a["data-part"])
        elif cls == "lh-leaf":
            self.leaf = dict(a, depth=len(self.stack), groups=list(self.groups),
                             stats={}, text={})
            self.leaves.append(self.leaf)
        elif self.leaf is not None and cls.startswith("lh-"):
            self.field = a.get("data-stat") or cls

    def handle_endtag(self, tag):
        open_tag, cls, _ = self.stack.pop()
        assert open_tag == tag, f"<{open_tag}> closed by </{tag}>"
        if cls == "lh-node":
            self.groups.pop()
        if self.leaf is not None and len(self.stack) < self.leaf["depth"]:
            self.leaf = None
        self.field = None

    def handle_data(self, data):
        if self.leaf is not None and self.field:
            self.leaf["text"][self.field] = self.leaf["text"].get(self.field, "") + data


def parse(text):
    p = Leaves()
    p.feed(text)
    p.close()
    assert not p.stack, "unclosed tags"
    return p


def test_html_tree_keys_shapes_states_and_stats():
    d = partly_computed()
    before = COMPILES.count
    p = parse(display.to_html(d, backend="plain"))
    assert COMPILES.count == before  # displaying compiles nothing
    expected = numpy_leaves()
    assert sorted(x["data-key"] for x in p.leaves) == sorted(expected)
    by_key = {x["data-key"]: x for x in p.leaves}
    assert by_key["('vjp', 'block', 'h1')"]["groups"] == ["vjp", "block"]
    assert by_key["('vjp', 'h0')"]["groups"] == ["vjp"]
    assert by_key["h0"]["groups"] == []
    for key, want in expected.items():
        leaf = by_key[key]
        assert leaf["text"]["lh-shape"] == str(want.shape)
        assert leaf["text"]["lh-dtype"] == "float32"
        assert leaf["text"]["lh-name"] == re.findall(r"\w+", key)[-1]
        state = leaf["text"]["lh-state"]
        assert state == leaf["data-state"]
        if key in ("h0", "('vjp', 'block', 'h1')"):
            assert state == "pending" and "mean" not in leaf["text"]
            continue
        assert state == "computed"
        for stat, fn in (("mean", np.mean), ("min", np.min), ("max", np.max)):
            shown = float(leaf["text"][stat].split()[-1])
            np.testing.assert_allclose(shown, fn(want), rtol=1e-3, atol=1e-6)
    assert not d.is_computed("h0") and not d.is_computed("vjp", "block", "h1")


def test_html_escapes_names_and_renders_odd_leaves():
    def f(key, x):
        sow(x, tag="t", name="<script>alert(1)</script>&")
        sow(key, tag="t", name="key")
        sow(jnp.arange(3), tag="t", name="ints")
        sow(x > 0, tag="t", name="mask")
        sow({"w": x, "n": (x / 0.0, jnp.int8(3))}, tag="t", name="tree")
        return jnp.sum(x)
    d = lh.reap(f, tag="t")(jax.random.key(0), jnp.linspace(-1, 1, 4))
    for forced in (False, True):
        if forced:
            d.compute()
        p = parse(display.to_html(d, backend="plain"))
        assert "script" not in p.tags
        keys = [x["data-key"] for x in p.leaves]
        assert keys == ["<script>alert(1)</script>&", "key", "ints", "mask", "tree"]
        assert len(str(d.summary()).splitlines()) == 2 + 4 + 3  # header, rule, rows
    table = d.summary()
    assert {r.key: r.note for r in table}["key"] == "PRNG key"
    assert {r.key: r.l2 for r in table}["ints"] is None
    assert not np.isfinite({r.key: r.l2 for r in table}["tree['n'][0]"])


def test_html_inside_a_trace_shows_tracers_and_forces_nothing_else():
    loss = make_loss()

    @jax.jit
    def g(x):
        d = lh.reap(jax.grad(loss), tag="act")(W0, W1, x)
        d["vjp", "h0"]
        p = parse(display.to_html(d, backend="plain"))
        notes = {x["data-key"]: x["text"].get("lh-note") for x in p.leaves}
        assert notes["('vjp', 'h0')"] == "traced"
        rows = {r.key: r for r in d.summary()}
        assert rows["('vjp', 'h0')"].note == "traced"
        assert rows["h0"].state == "pending" and not d.is_computed("h0")
        return d["vjp", "h0"]
    g(X)


def test_repr_html_uses_treescope_when_installed():
    pytest.importorskip("treescope")
    d = partly_computed()
    text = d._repr_html_()
    assert "treescope" in text and "2 computed, 2 pending" in text
    assert not d.is_computed("h0")


def test_repr_html_falls_back_to_plain_html(monkeypatch):
    monkeypatch.setitem(sys.modules, "treescope", None)  # as if not installed
    d = partly_computed()
    assert len(parse(d._repr_html_()).leaves) == 4
    with pytest.raises(ImportError, match=r"lazyharvest\[treescope\]"):
        display.to_html(d, backend="treescope")


def summary_rows(table):
    lines = str(table).splitlines()
    assert lines[0].split() == ["key", "shape", "dtype", "state", "l2", "norm", "max", "|x|"]
    assert set(lines[1]) <= {"-", " "}
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", l) for l in lines[2:])}


def test_summary_rows_and_norms():
    d = partly_computed()
    before = COMPILES.count
    table = d.summary()
    assert COMPILES.count == before
    rows = summary_rows(table)
    expected = numpy_leaves()
    assert sorted(rows) == sorted(expected) and len(table) == len(d)
    for key, want in expected.items():
        row = rows[key]
        assert row[1:4] == [str(want.shape), "float32",
                            "pending" if key in ("h0", "('vjp', 'block', 'h1')") else "computed"]
        if row[3] == "computed":
            np.testing.assert_allclose(float(row[4]), np.sqrt(np.sum(want ** 2)), rtol=1e-5)
            np.testing.assert_allclose(float(row[5]), np.abs(want).max(), rtol=1e-5)
        else:
            assert len(row) == 4
    assert not d.is_computed("h0")
    assert len(parse_rows(table._repr_html_())) == 1 + len(d)


def parse_rows(text):
    return re.findall(r"<tr>", text)


def test_summary_compute_forces_everything_in_one_program():
    d = reaped()
    before = COMPILES.count
    rows = summary_rows(d.summary(compute=True))
    assert COMPILES.count - before == 1
    assert all(r[3] == "computed" for r in rows.values())
    for key, want in numpy_leaves().items():
        np.testing.assert_allclose(float(rows[key][4]), np.sqrt(np.sum(want ** 2)), rtol=1e-5)
    assert all(d.is_computed(*(k if isinstance(k, tuple) else (k,))) for k in d)


# -- plots ---------------------------------------------------------------------


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


def test_site_norms_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from lazyharvest import plot
    d = reaped()
    before = COMPILES.count
    fig = plot.site_norms(d, path=tmp_path / "norms.png")
    assert COMPILES.count - before == 1  # the cotangents, in one program
    assert is_png(tmp_path / "norms.png")
    expected = numpy_leaves()
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    want = [np.linalg.norm(expected[k]) for k in ("('vjp', 'h0')", "('vjp', 'block', 'h1')")]
    np.testing.assert_allclose(heights, want, rtol=1e-5)  # site order: h0, then block/h1
    assert not d.is_computed("h0")
    fig = plot.site_norms(d, keys=["h0", "block"])
    assert len(fig.axes[0].patches) == 2


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (2, 2, 3, 5, 4)])
def test_attention_grid_plot(tmp_path, shape):
    pytest.importorskip("matplotlib")
    from lazyharvest import plot
    value = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), shape), axis=-1)
    fig = plot.attention_grid(value, path=tmp_path / "attn.png")
    assert is_png(tmp_path / "attn.png")
    layers, heads = shape[0], shape[-3]
    assert len(fig.axes) == layers * heads + 1  # and a colorbar
    with pytest.raises(ValueError, match="layers, heads"):
        plot.attention_grid(value[0, 0])


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    from lazyharvest import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"lazyharvest\[plot\]"):
        plot.attention_grid(np.zeros((1, 1, 2, 2)))


def test_import_never_imports_matplotlib():
    code = ("import sys, lazyharvest, lazyharvest.plot, lazyharvest.display; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
