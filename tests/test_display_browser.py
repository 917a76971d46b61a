"""The notebook HTML of a DelayedDict in a real browser: headless Chromium
lays the page out, and a script in it measures where each column starts
(the layout the user sees, not the HTML string). `.ci/run` installs Chromium
from Debian's packages; without one the tests skip, saying so."""

import json
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from lazyharvest import display

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium on this machine: install Debian's "
    "`chromium` package (.ci/run does where it can)")

# After the page has loaded: the left edge of every column cell of every row
# (the rows of leaves and of a pytree leaf's parts), whether a name fits its
# cell, and the text of treescope's shadow root; written into the page.
MEASURE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const rows = [...document.querySelectorAll("div.lh-leaf, div.lh-part")];
  const cols = {};
  for (const row of rows) {
    for (const cell of row.querySelectorAll(":scope > span")) {
      const name = cell.className + (cell.dataset.stat ? ":" + cell.dataset.stat : "");
      (cols[name] = cols[name] || []).push(cell.getBoundingClientRect().left);
    }
  }
  const fits = rows.map(r => {
    const n = r.querySelector(":scope > .lh-name");
    return n.scrollWidth <= n.clientWidth;
  });
  const shadow = [...document.querySelectorAll("treescope-container")].map(
      c => c.shadowRoot ? c.shadowRoot.textContent : "");
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({cols, fits, rows: rows.length, shadow});
  document.body.appendChild(out);
}, 200));
</script>"""


def _measured(body: str, tmp_path) -> dict:
    page = tmp_path / "page.html"
    page.write_text(f"<html><head><meta charset='utf-8'></head><body>{body}{MEASURE}"
                    f"</body></html>", encoding="utf-8")
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         "--window-size=1400,900", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180)
    start = run.stdout.find('<pre id="measured">')
    assert start >= 0, f"the page did not run its measuring script: {run.stderr[-2000:]}"
    text = run.stdout[start + len('<pre id="measured">'):run.stdout.index("</pre>", start)]
    return json.loads(text.replace("&quot;", '"').replace("&amp;", "&")
                      .replace("&lt;", "<").replace("&gt;", ">"))


def _reaped():
    def f(x):
        h = lh.sow(jnp.tanh(x) * 100.0, tag="t", name="h1")
        g = lh.sow(jnp.sin(h).reshape(2, 2, 2), tag="t", name="h3")
        pair = lh.sow({"small": x * 1e-4, "wide": jnp.cos(x) * -12345.0}, tag="t", name="pair")
        extra = lh.sow(jnp.float32(-0.001), tag="t", name="a_much_longer_site_name")
        return jnp.sum(g ** 2) + extra + jnp.sum(pair["small"] + pair["wide"])
    d = lh.reap(jax.grad(f), tag="t")(jnp.arange(8.0))
    d.compute()
    return d


def test_plain_html_columns_line_up_in_a_browser(tmp_path):
    got = _measured(display.to_html(_reaped(), backend="plain"), tmp_path)
    assert got["rows"] >= 8  # leaves, nested cotangents and the pytree's parts
    assert all(got["fits"]), "a name overflows its column"
    for column in ("lh-shape", "lh-dtype", "lh-state", "lh-stat:mean", "lh-stat:std",
                   "lh-stat:min", "lh-stat:max"):
        lefts = got["cols"][column]
        assert len(lefts) >= 8 and max(lefts) - min(lefts) < 0.5, (column, lefts)


def test_treescope_html_shows_its_tree_at_once_in_a_browser(tmp_path):
    pytest.importorskip("treescope")
    d = _reaped()
    for attempt in range(2):  # the first renders of a process too
        got = _measured(display.to_html(d, backend="treescope"), tmp_path)
        (text,) = got["shadow"]
        assert "Loading" not in text, f"render {attempt}: {text[:200]}"
        assert "a_much_longer_site_name" in text and "vjp" in text, text[:500]
