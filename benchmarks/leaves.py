"""Lazy leaves vs hand-written JAX (SPEC section 6, bullets 2 to 5).

The model: an N-layer MLP whose every activation is a site,

    h = lh.sow(jnp.tanh(h @ W_i + b_i), tag="act", name=f"h{i}")

Sections (select some with `python benchmarks/leaves.py a c`; default all):
  (a) one leaf out of N sites, second call with same-shaped arguments (a new
      DelayedDict per call, one leaf forced) vs a hand-written jitted function
      computing just that activation; next to it an eager reap-everything
      baseline (one jitted function returning all N activations). N in
      {4, 8, 16, 32}; leaf h{N//2} (the spec's case) and h3 (a fixed depth, so
      the hand-written cost is the same for every N). Target <= 1.1x, flat in N.
  (b) `d.compute(*8 keys)` vs one hand-written jitted program returning the 8
      activations, and vs forcing the 8 leaves one by one. Target <= 1.25x.
  (c) first access: `lh.reap` of a fresh function object to the leaf's value
      (trace + slice + compile + run) vs `jax.jit(hand_written).lower(...)
      .compile()` + run of a fresh function. Target <= 2x.
  (d) memory of the compiled program forcing one leaf (and the K=8 program
      of `compute`) vs the hand-written one, from XLA's memory_analysis().
      Target <= 1.2x.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from _common import (
    CompileCounter,
    block,
    check_close,
    flag,
    fmt_bytes,
    fmt_ms,
    fmt_us,
    header,
    summary,
    table,
    time_interleaved,
    time_once_median,
)

import lazyharvest as lh

TAG = "act"
WIDTH = 128
BATCH = 64
T_LEAF, T_COMPUTE, T_FIRST, T_MEM = 1.1, 1.25, 2.0, 1.2

RESULTS: list[tuple[str, float, float]] = []
COMPILES = CompileCounter()


# --- model and hand-written programs ------------------------------------------

def make_params(n: int, width: int = WIDTH, batch: int = BATCH, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2 * n + 1)
    params = [(jax.random.normal(ks[2 * i], (width, width), jnp.float32) / width ** 0.5,
               0.1 * jax.random.normal(ks[2 * i + 1], (width,), jnp.float32))
              for i in range(n)]
    x = jax.random.normal(ks[-1], (batch, width), jnp.float32)
    return params, x


def make_model():
    """A fresh function object each call (no cache can know it)."""
    def mlp(params, x):
        h = x
        for i, (w, b) in enumerate(params):
            h = lh.sow(jnp.tanh(h @ w + b), tag=TAG, name=f"h{i}")
        return h
    return mlp


def make_hand_leaf(i: int):
    """Hand-written: just activation `i` (layers 0..i), nothing else."""
    def leaf(params, x):
        h = x
        for w, b in params[:i + 1]:
            h = jnp.tanh(h @ w + b)
        return h
    return leaf


def make_hand_leaves(idx: list[int]):
    """Hand-written: the activations `idx`, from one forward pass."""
    def leaves(params, x):
        h, out = x, {}
        for j, (w, b) in enumerate(params[:max(idx) + 1]):
            h = jnp.tanh(h @ w + b)
            if j in idx:
                out[f"h{j}"] = h
        return out
    return leaves


def make_eager_all():
    """Eager reap-everything baseline: every activation, as a dict."""
    def everything(params, x):
        h, out = x, {}
        for j, (w, b) in enumerate(params):
            h = jnp.tanh(h @ w + b)
            out[f"h{j}"] = h
        return out
    return everything


# --- (a) one leaf out of N -------------------------------------------------------

def section_a() -> None:
    print(f"(a) one leaf out of N sites; MLP width {WIDTH}, batch {BATCH}, f32; "
          f"second call (compiled program cached), new DelayedDict per call")
    rows = []
    lazy_by_leaf: dict[str, list[float]] = {"mid": [], "h3": []}
    for n in (4, 8, 16, 32):
        params, x = make_params(n)
        reaped = lh.reap(make_model(), tag=TAG)
        eager_all = jax.jit(make_eager_all())
        everything = eager_all(params, x)
        for which, i in (("mid", n // 2), ("h3", 3)):
            if which == "h3" and i == n // 2:
                lazy_by_leaf["h3"].append(lazy_by_leaf["mid"][-1])
                rows.append([n, f"h{i}", "(same as above)", "", "", "", "", "",
                             "", "", ""])
                continue
            k = f"h{i}"
            hand = jax.jit(make_hand_leaf(i))
            want = hand(params, x)
            check_close(reaped(params, x)[k], want, f"(a) N={n} {k}")
            check_close(everything[k], want, f"(a) eager-all N={n} {k}")
            block(eager_all(params, x))
            before = COMPILES.count
            t = time_interleaved({
                "lazy": lambda: reaped(params, x)[k].block_until_ready(),
                "hand": lambda: hand(params, x).block_until_ready(),
                "eager": lambda: block(eager_all(params, x)),
                "reap": lambda: reaped(params, x),
            }, number=150, repeat=7, warmup=10)
            assert COMPILES.count == before, "(a): a timed second call compiled"
            ratio = t["lazy"] / t["hand"]
            RESULTS.append((f"(a) N={n} leaf {k}", ratio, T_LEAF))
            lazy_by_leaf[which].append(t["lazy"])
            rows.append([n, k, fmt_us(t["lazy"]), fmt_us(t["hand"]),
                         f"{ratio:.2f}x", f"<= {T_LEAF:.2f}x", flag(ratio, T_LEAF),
                         fmt_us(t["eager"]), f"{t['eager'] / t['hand']:.2f}x",
                         fmt_us(t["lazy"] - t["hand"]), fmt_us(t["reap"])])
    table(["N", "leaf", "lazy leaf µs", "hand µs", "ratio", "target", "flag",
           "eager-all µs", "eager/hand", "lazy-hand µs", "reap() µs"], rows)
    print("lazy leaf = lh.reap(f)(params, x)[leaf]: reap() call + one forced leaf.")
    print("lazy-hand µs = what the lazy path adds per call; reap() µs = the "
          "lh.reap(f)(params, x)\ncall alone (trace-cache lookup, new DelayedDict, "
          "nothing forced). The arguments\nare 2N+1 arrays, so per-argument costs "
          "grow with N here.")
    h3 = lazy_by_leaf["h3"]
    print(f"flatness: lazy h3 (fixed depth) from N=4 to N=32: {fmt_us(h3[0])} -> "
          f"{fmt_us(h3[-1])} µs ({h3[-1] / h3[0]:.2f}x); the hand-written h3 "
          f"program is the same for every N.")
    print()


# --- (b) K leaves with compute ----------------------------------------------------

def section_b() -> None:
    n = 32
    idx = list(range(3, n, 4))  # h3, h7, ..., h31: 8 leaves, spread over the net
    keys = [f"h{i}" for i in idx]
    print(f"(b) d.compute() of K={len(keys)} leaves {keys[0]}..{keys[-1]} of an "
          f"N={n} MLP (width {WIDTH}, batch {BATCH})")
    params, x = make_params(n)
    reaped = lh.reap(make_model(), tag=TAG)
    hand = jax.jit(make_hand_leaves(idx))
    eager_all = jax.jit(make_eager_all())
    want = hand(params, x)

    def one_by_one():
        d = reaped(params, x)
        return {k: d[k] for k in keys}

    check_close(reaped(params, x).compute(*keys), want, "(b) compute")
    check_close(one_by_one(), want, "(b) one by one")
    block(eager_all(params, x))
    before = COMPILES.count
    t = time_interleaved({
        "compute": lambda: block(reaped(params, x).compute(*keys)),
        "hand": lambda: block(hand(params, x)),
        "one": lambda: block(one_by_one()),
        "eager": lambda: block(eager_all(params, x)),
    }, number=100, repeat=7, warmup=5)
    assert COMPILES.count == before, "(b): a timed second call compiled"
    ratio = t["compute"] / t["hand"]
    RESULTS.append(("(b) compute K=8", ratio, T_COMPUTE))
    rows = [
        ["d.compute(*8 keys)", fmt_us(t["compute"]), f"{ratio:.2f}x",
         f"<= {T_COMPUTE:.2f}x", flag(ratio, T_COMPUTE)],
        ["hand-written, 8 outputs", fmt_us(t["hand"]), "1.00x", "", ""],
        ["8 leaves one by one (d[k])", fmt_us(t["one"]),
         f"{t['one'] / t['hand']:.2f}x", "(info)", ""],
        [f"eager reap-everything ({n})", fmt_us(t["eager"]),
         f"{t['eager'] / t['hand']:.2f}x", "(info)", ""],
    ]
    table(["program", "µs/call", "vs hand", "target", "flag"], rows)


# --- (c) first access ---------------------------------------------------------------

def section_c() -> None:
    print(f"(c) first access: fresh function object, nothing cached "
          f"(width {WIDTH}, batch {BATCH}); median of 5")
    rows = []
    for n in (8, 32):
        params, x = make_params(n)
        i = n // 2
        k = f"h{i}"
        want = jax.jit(make_hand_leaf(i))(params, x)

        def fresh(fn):  # checks that the call compiled: nothing was cached
            def run():
                before = COMPILES.count
                out = fn()
                assert COMPILES.count > before, f"(c) {fn.__name__}: no compile"
                return out
            return run

        @fresh
        def lazy():
            d = lh.reap(make_model(), tag=TAG)(params, x)
            return d[k].block_until_ready()

        @fresh
        def hand():
            c = jax.jit(make_hand_leaf(i)).lower(params, x).compile()
            return c(params, x).block_until_ready()

        @fresh
        def eager():
            c = jax.jit(make_eager_all()).lower(params, x).compile()
            return block(c(params, x))

        def reap_only():  # the abstract trace alone, no leaf forced
            return lh.reap(make_model(), tag=TAG)(params, x)

        check_close(lazy(), want, f"(c) N={n} {k}")
        check_close(hand(), want, f"(c) hand N={n}")
        t = time_once_median({"lazy": lazy, "hand": hand, "eager": eager,
                              "reap": reap_only}, repeat=5)
        ratio = t["lazy"] / t["hand"]
        RESULTS.append((f"(c) first access N={n}", ratio, T_FIRST))
        rows.append([n, k, fmt_ms(t["lazy"]), fmt_ms(t["reap"]),
                     fmt_ms(t["lazy"] - t["reap"]), fmt_ms(t["hand"]),
                     f"{ratio:.2f}x", f"<= {T_FIRST:.2f}x", flag(ratio, T_FIRST),
                     fmt_ms(t["eager"])])
    table(["N", "leaf", "lazy ms", "of which reap()", "of which d[k]", "hand ms",
           "ratio", "target", "flag", "eager-all ms"], rows)
    print("lazy = lh.reap(fresh f)(params, x)[leaf], to the value; reap() = the "
          "abstract trace\nand site analysis alone; d[k] = slicing, compiling "
          "and running the leaf's program.\nhand = jax.jit(fresh hand-written)"
          ".lower().compile() + run. eager-all: the same for\nthe reap-everything "
          "program.")
    print()


# --- (d) memory ----------------------------------------------------------------------

def _mem(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {"arg": m.argument_size_in_bytes, "out": m.output_size_in_bytes,
           "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
    out["total"] = out["arg"] + out["out"] + out["temp"] - out["alias"]
    return out


def _lazy_compiled(d, keys: list[str]):
    """The compiled program lazyharvest runs to force `keys` of `d`.

    Uses internals (there is no public hook): the DelayedDict's store holds
    the Traced function and the flat arguments; `Traced.program(raw_keys)` is
    the (cached) slice whose `.fn` is a `jax.jit`.
    """
    store = d._store
    traced = store.traced
    raw = [traced.raw_of[(k,)] for k in keys]
    prog = traced.program(raw, with_out=False)
    return prog.fn.lower(*store.args, *store.plant_leaves).compile()


def section_d() -> None:
    n, width, batch = 32, 256, 256
    print(f"(d) memory (XLA memory_analysis of the compiled programs), N={n} MLP, "
          f"width {width}, batch {batch}, f32")
    params, x = make_params(n, width, batch)
    reaped = lh.reap(make_model(), tag=TAG)
    rows = []

    def row(what, lazy_keys, hand_fn):
        d = reaped(params, x)
        want = jax.jit(hand_fn)(params, x)
        got = d[lazy_keys[0]] if len(lazy_keys) == 1 else d.compute(*lazy_keys)
        check_close(got, want, f"(d) {what}")
        lm = _lazy_compiled(d, lazy_keys)
        hm = _mem(jax.jit(hand_fn).lower(params, x).compile())
        lm = _mem(lm)
        ratio = lm["total"] / hm["total"]
        work_ratio = (lm["out"] + lm["temp"]) / max(1, hm["out"] + hm["temp"])
        RESULTS.append((f"(d) memory {what}", ratio, T_MEM))
        for who, m in (("lazy", lm), ("hand", hm)):
            rows.append([what if who == "lazy" else "", who, fmt_bytes(m["arg"]),
                         fmt_bytes(m["out"]), fmt_bytes(m["temp"]),
                         fmt_bytes(m["total"]),
                         *( [f"{ratio:.2f}x", f"{work_ratio:.2f}x",
                             f"<= {T_MEM:.2f}x", flag(ratio, T_MEM)]
                           if who == "lazy" else ["", "", "", ""])])

    i = n // 2
    row(f"leaf h{i}", [f"h{i}"], make_hand_leaf(i))
    idx = list(range(3, n, 4))
    row("compute K=8", [f"h{j}" for j in idx], make_hand_leaves(idx))
    em = _mem(jax.jit(make_eager_all()).lower(params, x).compile())
    rows.append([f"eager-all ({n})", "hand", fmt_bytes(em["arg"]),
                 fmt_bytes(em["out"]), fmt_bytes(em["temp"]),
                 fmt_bytes(em["total"]), "", "", "(info)", ""])
    table(["program", "who", "args", "outputs", "temps", "total", "ratio",
           "out+temp ratio", "target", "flag"], rows)
    print("total = args + outputs + temps - aliased; 'ratio' compares totals "
          "(the target),\n'out+temp ratio' leaves the (shared) inputs out.")
    print()


SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


def main(argv: list[str]) -> None:
    chosen = argv or list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    header("leaves.py: lazy leaves of lh.reap vs hand-written JAX")
    for s in chosen:
        SECTIONS[s]()
    summary(RESULTS)


if __name__ == "__main__":
    main(sys.argv[1:])
