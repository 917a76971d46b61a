"""`sow` outside a harvest costs nothing (SPEC section 6, first bullet).

The same function, with and without `lh.sow` calls, no harvest active:
  * dispatch: a tiny jitted function (8 floats), called 5000 times per repeat,
    blocking on every result (round trip), and without blocking (enqueue);
  * run time: a larger jitted function (8 layers of 512x512 matmul + tanh);
  * the same after a harvest of the tag has traced the function (the jitted
    function must go back to its fast path);
  * an eager (un-jitted) call of the tiny function, where `sow` is plain
    Python (validation, then the identity).
Target: ratio (with sow / without) <= 1.05x.

Run: python benchmarks/dispatch.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from _common import check_close, flag, fmt_us, header, summary, table, time_interleaved

import lazyharvest as lh

TARGET = 1.05
TAG = "act"


# --- the functions: identical but for the sow calls --------------------------

def tiny_sow(x):
    y = lh.sow(jnp.sin(x), tag=TAG, name="a")
    z = lh.sow({"u": y * 2.0 + 1.0, "v": y - 1.0}, tag=TAG, name="b")
    return lh.sow(jnp.tanh(z["u"] * z["v"]), tag=TAG, name="c").sum()


def tiny_plain(x):
    y = jnp.sin(x)
    z = {"u": y * 2.0 + 1.0, "v": y - 1.0}
    return jnp.tanh(z["u"] * z["v"]).sum()


def mlp_sow(ws, x):
    h = x
    for i, w in enumerate(ws):
        h = lh.sow(jnp.tanh(h @ w), tag=TAG, name=f"h{i}")
    return h


def mlp_plain(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return h


def _hlo_body(lowered) -> str:
    """StableHLO text without the module/function names (which differ)."""
    text = lowered.as_text()
    text = re.sub(r"@jit_\w+", "@jit_F", text)
    text = re.sub(r"loc\(.*?\)", "", text)
    return text


def main() -> None:
    header("dispatch.py: jitted function with lh.sow (no harvest active) vs "
           "the same function without sow")

    key = jax.random.PRNGKey(0)
    x_tiny = jax.random.normal(key, (8,), jnp.float32)
    width, depth, batch = 512, 8, 512
    ks = jax.random.split(key, depth + 1)
    ws = [jax.random.normal(k, (width, width), jnp.float32) / width ** 0.5
          for k in ks[:depth]]
    x_big = jax.random.normal(ks[-1], (batch, width), jnp.float32)

    jt_sow, jt_plain = jax.jit(tiny_sow), jax.jit(tiny_plain)
    jm_sow, jm_plain = jax.jit(mlp_sow), jax.jit(mlp_plain)

    # Correctness first: never time a wrong program.
    check_close(jt_sow(x_tiny), jt_plain(x_tiny), "tiny: jit with sow")
    check_close(tiny_sow(x_tiny), tiny_plain(x_tiny), "tiny: eager with sow")
    check_close(jm_sow(ws, x_big), jm_plain(ws, x_big), "mlp: jit with sow")
    same_tiny = _hlo_body(jt_sow.lower(x_tiny)) == _hlo_body(jt_plain.lower(x_tiny))
    same_mlp = _hlo_body(jm_sow.lower(ws, x_big)) == _hlo_body(jm_plain.lower(ws, x_big))
    print(f"StableHLO with sow == without sow: tiny {same_tiny}, mlp {same_mlp}")
    print()

    rows, results = [], []

    def add(what: str, n_calls: int, fns: dict, number: int, repeat: int) -> None:
        t = time_interleaved(fns, number=number, repeat=repeat, warmup=20)
        a, b = t["sow"], t["plain"]
        ratio = a / b
        rows.append([what, n_calls, fmt_us(a), fmt_us(b), fmt_us(a - b),
                     f"{ratio:.3f}x", f"<= {TARGET:.2f}x", flag(ratio, TARGET)])
        results.append((what, ratio, TARGET))

    def enqueue(fn, arg, n):
        def run():
            out = None
            for _ in range(n):
                out = fn(arg)
            out.block_until_ready()
        return run

    n_tiny = 5000
    add("jit dispatch+wait, f32[8]", n_tiny,
        {"sow": lambda: jt_sow(x_tiny).block_until_ready(),
         "plain": lambda: jt_plain(x_tiny).block_until_ready()},
        number=n_tiny, repeat=7)
    # Enqueue only: one block at the end of 5000 calls; per-call time.
    t = time_interleaved({"sow": enqueue(jt_sow, x_tiny, n_tiny),
                          "plain": enqueue(jt_plain, x_tiny, n_tiny)},
                         number=1, repeat=7, warmup=2)
    ratio = t["sow"] / t["plain"]
    rows.append(["jit dispatch (async), f32[8]", n_tiny, fmt_us(t["sow"] / n_tiny),
                 fmt_us(t["plain"] / n_tiny), fmt_us((t["sow"] - t["plain"]) / n_tiny),
                 f"{ratio:.3f}x", f"<= {TARGET:.2f}x", flag(ratio, TARGET)])
    results.append(("jit dispatch (async), f32[8]", ratio, TARGET))

    add(f"jit run, {depth}x f32[{batch},{width}]@[{width},{width}]", 20,
        {"sow": lambda: jm_sow(ws, x_big).block_until_ready(),
         "plain": lambda: jm_plain(ws, x_big).block_until_ready()},
        number=20, repeat=11)

    # A harvest of the same jitted function retraces it with effectful sites;
    # plain calls afterwards must still take the fast, site-free path.
    d = lh.reap(jt_sow, tag=TAG)(x_tiny)
    check_close(d["a"], jnp.sin(x_tiny), "reap of jitted tiny: leaf 'a'")
    check_close(jt_sow(x_tiny), jt_plain(x_tiny), "tiny after reap")
    add("jit dispatch+wait after a reap", n_tiny,
        {"sow": lambda: jt_sow(x_tiny).block_until_ready(),
         "plain": lambda: jt_plain(x_tiny).block_until_ready()},
        number=n_tiny, repeat=7)

    add("eager (no jit), f32[8]", 1000,
        {"sow": lambda: tiny_sow(x_tiny).block_until_ready(),
         "plain": lambda: tiny_plain(x_tiny).block_until_ready()},
        number=1000, repeat=7)

    table(["case", "calls/rep", "with sow µs", "plain JAX µs", "diff µs",
           "ratio", "target", "flag"], rows)
    print("The eager row has 3 sow calls (one of a 2-leaf dict) around 7 jnp "
          "ops; 'diff'\nis what those sow calls cost per function call.")
    summary(results)


if __name__ == "__main__":
    main()
