"""Loops, per-call overhead, scaling and training steps vs hand-written JAX
(SPEC section 6: first access, memory, "in a loop", recorded transforms,
training step with activation gradients).

Sections (select some with `python benchmarks/loops.py a d`, or parts of (d)
with d1..d4; default all):
  (a) plant sweep: 512 `lh.plant` calls (32 corrupted runs x 16 column blocks
      of patch values, same shapes) into layer 16 of a 32-layer MLP (width
      256, batch 64) vs a jitted hand-written function taking the patch as an
      argument. Per call <= 1.1x; compiles after the first call: 0.
  (a2) intervention sweep: the same 512 calls as function plants,
      `lh.intervention(patch_block, src, cols, on)` with the corrupted
      activation and the column block as operands, vs the jitted hand-written
      intervention taking them as arguments. Per call <= 1.1x; compiles after
      the first call: 0.
  (b) `lh.reap(lh.grad(f))(x, params)[("grad", "e16")]`, the wrapper rebuilt
      every call, vs `jax.jit(jax.grad(slice))`. <= 1.1x; 0 compiles after
      the first call.
  (c) per-call overhead: `reap(f)(*args)` + one leaf read (and + a cached
      `compute` of 2 leaves; and a `plant(f)` call) for f of 1, 8 and 64 array
      arguments vs the jitted hand-written program: µs above it, <= 5 µs at 8
      arguments.
  (d) first access as programs grow. d1: 100, 1,000, 5,000 sites (10 eqns
      each) in straight-line code, in one scan body (append) and in nested
      jits: first reap vs `jax.jit(f).trace(x).lower()`, <= 2x, per-site
      time flat (a 5,000-site run estimated above 60 s is skipped). d2: a
      24-layer transformer under jax.grad, <= 2x. d3: nested recorded
      transforms, reap < 2 s. d4: per-example gradients
      `lh.vmap(lh.grad(loss))`, first leaf vs `jax.jit(jax.vmap(jax.grad(
      loss)))` first call, <= 2x.
  (e) one leaf in a while_loop (a cheap carry it needs, a matmul carry it does
      not) vs its hand-written slice: time <= 1.1x, memory <= 1.2x.
  (f) training step with all 12 activation gradients of a 6-layer transformer
      (d_model 128, 4 heads, seq 64, batch 8) in one jitted step: the
      perturbation trick (1) vs lh.reap of a sown loss (2), call_and_reap (3)
      and Flax linen `perturb` (4, if Flax is installed): steady <= 1.05x,
      same FLOPs, first call <= 1.2x.
  (f2) the same with every layer a jax.checkpoint, sites inside (no (4));
      run with JAX_REMAT3=true for JAX's jax_remat3 implementation.
  (g) the same training step eagerly (no jax.jit around it):
      `lh.call_and_reap(jax.value_and_grad(loss))` then `d.compute()` of the
      12 activation gradients, steady state, vs the jitted perturbation trick
      called eagerly: <= 1.1x, same FLOPs (cost_analysis of every program a
      step runs).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

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
    table,
    time_interleaved,
)
from jax import lax

import lazyharvest as lh

T = "t"
T_LOOP, T_US, T_FIRST, T_MEM, T_NESTED_S = 1.1, 5.0, 2.0, 1.2, 2.0
T_STEP, T_STEP_FIRST = 1.05, 1.2

RESULTS: list[tuple[str, float, float, str]] = []  # (what, value, target, unit)
COMPILES = CompileCounter()


def record(what: str, value: float, target: float, unit: str = "x") -> str:
    """Remembers a measurement for the summary; returns its PASS/ABOVE flag."""
    RESULTS.append((what, value, target, unit))
    return flag(value, target)


def seconds(fn, repeat: int = 1):
    """Median wall seconds of `fn()` over `repeat` calls, and its last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


# --- an MLP (sections a, b, d) ---------------------------------------------------

def mlp_params(n: int, width: int, batch: int, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 2 * n + 1)
    params = [(jax.random.normal(ks[2 * i], (width, width)) / width ** 0.5,
               0.1 * jax.random.normal(ks[2 * i + 1], (width,))) for i in range(n)]
    return params, jax.random.normal(ks[-1], (batch, width))


def mlp(params, x):
    """Every activation is a site `h{i}`."""
    h = x
    for i, (w, b) in enumerate(params):
        h = lh.sow(jnp.tanh(h @ w + b), tag=T, name=f"h{i}")
    return h


def mlp_upto(params, x, layer: int):
    """Hand-written: activation `layer` of the MLP."""
    h = x
    for w, b in params[:layer + 1]:
        h = jnp.tanh(h @ w + b)
    return h


def hand_patched(layer: int):
    """Hand-written: the MLP with activation `layer` replaced by `patch`."""
    def patched(params, x, patch):
        h = x
        for i, (w, b) in enumerate(params):
            h = patch if i == layer else jnp.tanh(h @ w + b)
        return h
    return patched


# --- (a) plant sweep -----------------------------------------------------------------

def section_a() -> None:
    n, width, batch, layer, runs, blocks = 32, 256, 64, 16, 32, 16
    print(f"(a) plant sweep: {runs * blocks} lh.plant calls patching h{layer} of a "
          f"{n}-layer MLP (width {width}, batch {batch}); {runs} corrupted runs x "
          f"{blocks} column blocks")
    params, x = mlp_params(n, width, batch)
    corrupt = jax.random.normal(jax.random.PRNGKey(1), (runs, batch, width))

    @jax.jit
    def make_patches(params, x, corrupt):  # clean h16 with one block from a corrupted run
        clean = mlp_upto(params, x, layer)
        bad = jax.vmap(lambda c: mlp_upto(params, c, layer))(corrupt)
        cols = jnp.arange(width) // (width // blocks)
        mask = cols[None, :] == jnp.arange(blocks)[:, None, None]  # (blocks, 1, width)
        return jnp.where(mask[None], bad[:, None], clean).reshape(-1, batch, width)

    patches = list(make_patches(params, x, corrupt))
    planted = lh.plant(mlp, tag=T)
    hand = jax.jit(hand_patched(layer))
    time_sweep("(a) plant sweep", patches,
               lambda p: planted({f"h{layer}": p}, params, x),
               lambda p: hand(params, x, p))
    print("lazy = lh.plant(mlp)({'h16': patch}, params, x) per patch; hand = "
          "jax.jit(patched)(params, x, patch).\nEvery call waits for its result; "
          "'compiles after' counts the 3 timed sweeps after the first call.\n")


def time_sweep(what: str, calls: list, lazy_one, hand_one) -> None:
    """Times `lazy_one(c)` against `hand_one(c)` over `calls` (interleaved
    sweeps, each call waiting for its result), after checking the first and
    last calls agree; records the per-call ratio and the compiles after the
    first call, and prints their row."""
    before = COMPILES.count
    first = block(lazy_one(calls[0]))
    first_compiles = COMPILES.count - before
    check_close(first, hand_one(calls[0]), f"{what}: first call")
    check_close(lazy_one(calls[-1]), hand_one(calls[-1]), f"{what}: last call")

    def sweep(one):
        return lambda: [one(c).block_until_ready() for c in calls]

    before = COMPILES.count
    t = time_interleaved({"lazy": sweep(lazy_one), "hand": sweep(hand_one)}, number=1,
                         repeat=3, warmup=0)
    after = COMPILES.count - before
    lazy, hand_t = t["lazy"] / len(calls), t["hand"] / len(calls)
    ratio = lazy / hand_t
    f1 = record(f"{what}, per call", ratio, T_LOOP)
    f2 = record(f"{what}, compiles after the first call", after, 0, "")
    table(["calls", "lazy µs/call", "hand µs/call", "ratio", "target", "flag",
           "lazy-hand µs", "compiles (first call)", "compiles after", "flag"],
          [[len(calls), fmt_us(lazy), fmt_us(hand_t), f"{ratio:.2f}x",
            f"<= {T_LOOP:.2f}x", f1, fmt_us(lazy - hand_t), first_compiles, after, f2]])



# --- (a2) intervention sweep ---------------------------------------------------------

def patch_block(h, src, cols, on):
    """Column block `on` of `h` from `src` (a function plant's operands)."""
    return jnp.where(cols == on, src, h)


def hand_intervened(layer: int):
    """Hand-written: the MLP with `patch_block` applied at activation `layer`."""
    def intervened(params, x, src, cols, on):
        h = x
        for i, (w, b) in enumerate(params):
            h = jnp.tanh(h @ w + b)
            h = patch_block(h, src, cols, on) if i == layer else h
        return h
    return intervened


def section_a2() -> None:
    n, width, batch, layer, runs, blocks = 32, 256, 64, 16, 32, 16
    print(f"(a2) intervention sweep: {runs * blocks} lh.plant calls of "
          f"lh.intervention(patch_block, src, cols, on) at h{layer} of a {n}-layer MLP "
          f"(width {width}, batch {batch}); {runs} corrupted runs x {blocks} column "
          f"blocks, the corrupted activation and the block as operands")
    params, x = mlp_params(n, width, batch)
    corrupt = jax.random.normal(jax.random.PRNGKey(1), (runs, batch, width))
    srcs = list(jax.jit(jax.vmap(lambda c: mlp_upto(params, c, layer)))(corrupt))
    cols = jnp.arange(width) // (width // blocks)
    calls = [(src, jnp.int32(k)) for src in srcs for k in range(blocks)]
    planted = lh.plant(mlp, tag=T)
    hand = jax.jit(hand_intervened(layer))

    time_sweep("(a2) intervention sweep", calls,
               lambda c: planted({f"h{layer}": lh.intervention(patch_block, c[0], cols, c[1])},
                                 params, x),
               lambda c: hand(params, x, c[0], cols, c[1]))
    print("lazy = lh.plant(mlp)({'h16': lh.intervention(patch_block, src, cols, on)}, "
          "params, x) per call (the function defined once); hand = jax.jit(intervened)"
          "(params, x, src, cols, on).\n")

# --- (b) reap of a rebuilt lh.grad wrapper ---------------------------------------------

def energy_mlp(x, params):
    """Sites `e{i}`: the mean square of each activation (scalars)."""
    h = x
    for i, (w, b) in enumerate(params):
        h = jnp.tanh(h @ w + b)
        lh.sow(jnp.mean(h ** 2), tag=T, name=f"e{i}")
    return jnp.mean(h ** 2)


def section_b() -> None:
    n, width, batch, site = 32, 256, 64, 16
    key = ("grad", f"e{site}")
    print(f"(b) lh.reap(lh.grad(f))(x, params)[{key}], wrapper rebuilt every call; "
          f"{n}-layer MLP (width {width}, batch {batch}); 4 inputs in turn")
    params, x0 = mlp_params(n, width, batch)
    xs = [x0 * (1 + 0.1 * i) for i in range(4)]

    hand = jax.jit(jax.grad(lambda x, params: jnp.mean(mlp_upto(params, x, site) ** 2)))
    lazy_fn = lambda x: lh.reap(lh.grad(energy_mlp), tag=T)(x, params)[key]
    before = COMPILES.count
    first = block(lazy_fn(xs[0]))
    first_compiles = COMPILES.count - before
    check_close(first, hand(xs[0], params), "(b) first input")
    check_close(lazy_fn(xs[1]), hand(xs[1], params), "(b) second input")
    lazy_in, hand_in = itertools.cycle(xs), itertools.cycle(xs)
    before = COMPILES.count
    t = time_interleaved({
        "lazy": lambda: lazy_fn(next(lazy_in)).block_until_ready(),
        "hand": lambda: hand(next(hand_in), params).block_until_ready(),
        "reap": lambda: lh.reap(lh.grad(energy_mlp), tag=T)(next(lazy_in), params),
    }, number=40, repeat=5, warmup=4)
    after = COMPILES.count - before
    ratio = t["lazy"] / t["hand"]
    f1 = record("(b) reap(lh.grad(f)) rebuilt, per call", ratio, T_LOOP)
    f2 = record("(b) reap(lh.grad(f)) rebuilt, compiles after the first call", after, 0, "")
    table(["lazy µs/call", "hand µs/call", "ratio", "target", "flag", "lazy-hand µs",
           "reap() µs", "compiles (first call)", "compiles after", "flag"],
          [[fmt_us(t["lazy"]), fmt_us(t["hand"]), f"{ratio:.2f}x", f"<= {T_LOOP:.2f}x",
            f1, fmt_us(t["lazy"] - t["hand"]), fmt_us(t["reap"]), first_compiles,
            after, f2]])
    print(f"hand = jax.jit(jax.grad(x -> mean(h{site}(x)**2)))(x, params); reap() = "
          "lh.reap(lh.grad(f))(x, params) alone.\n")


# --- (c) per-call overhead ------------------------------------------------------------------

def many_args(*xs):
    s = xs[0]
    for v in xs[1:]:
        s = s + v
    a = lh.sow(jnp.sin(s), tag=T, name="a")
    b = lh.sow(a * 2. + 1., tag=T, name="b")
    c = lh.sow(jnp.tanh(b), tag=T, name="c")
    return jnp.sum(c)


def _hand_many(*xs):
    s = xs[0]
    for v in xs[1:]:
        s = s + v
    a = jnp.sin(s)
    return a, a * 2. + 1., jnp.tanh(a * 2. + 1.)


def section_c() -> None:
    print("(c) per-call overhead: lh.reap(f)(*args) + one leaf ('b'), and + "
          "d.compute('a', 'c') (cached key set); f of n arrays f32[16], 3 sites")
    hand_b = jax.jit(lambda *xs: _hand_many(*xs)[1])
    hand_ac = jax.jit(lambda *xs: (lambda a, b, c: {"a": a, "c": c})(*_hand_many(*xs)))
    hand_p = jax.jit(lambda p, *xs: jnp.sum(jnp.tanh(p)))
    reaped, planted = lh.reap(many_args, tag=T), lh.plant(many_args, tag=T)
    p = jnp.full((16,), 0.5, jnp.float32)
    rows = []
    for n in (1, 8, 64):
        xs = [jnp.full((16,), 0.01 * (i + 1)) for i in range(n)]
        check_close(reaped(*xs)["b"], hand_b(*xs), f"(c) n={n} leaf")
        check_close(reaped(*xs).compute("a", "c"), hand_ac(*xs), f"(c) n={n} compute")
        check_close(planted({"b": p}, *xs), hand_p(p, *xs), f"(c) n={n} plant")
        cont = reaped(*[x + 1.0 for x in xs]).fn("b")  # (a DelayedDict of other inputs)
        check_close(cont(*xs), hand_b(*xs), f"(c) n={n} continuation")
        before = COMPILES.count
        t = time_interleaved({
            "leaf": lambda: reaped(*xs)["b"].block_until_ready(),
            "hand": lambda: hand_b(*xs).block_until_ready(),
            "comp": lambda: block(reaped(*xs).compute("a", "c")),
            "hand2": lambda: block(hand_ac(*xs)),
            "plant": lambda: planted({"b": p}, *xs).block_until_ready(),
            "hand3": lambda: hand_p(p, *xs).block_until_ready(),
            "reap": lambda: reaped(*xs),
            "cont": lambda: cont(*xs).block_until_ready(),
        }, number=300, repeat=7, warmup=20)
        assert COMPILES.count == before, "(c): a timed call compiled"
        for what, lazy, ref in (("leaf d['b']", "leaf", "hand"),
                                ("d.fn('b')(*args)", "cont", "hand"),
                                ("d.compute('a','c')", "comp", "hand2"),
                                ("plant({'b': p})", "plant", "hand3")):
            diff = t[lazy] - t[ref]
            target, fl = "(info)", ""
            if n == 8:
                target = f"<= {T_US:.0f} µs"
                fl = record(f"(c) {what}, 8 args: µs above hand", diff * 1e6, T_US, " µs")
            rows.append([n, what, fmt_us(t[lazy]), fmt_us(t[ref]), fmt_us(diff),
                         f"{t[lazy] / t[ref]:.2f}x", target, fl,
                         fmt_us(t["reap"]) if lazy == "leaf" else ""])
    table(["args", "read", "lazy µs", "hand µs", "lazy-hand µs", "ratio", "target",
           "flag", "reap() µs"], rows)
    print("hand = the jitted hand-written program for the same leaf (leaves), or for "
          "the planted output (plant); reap() = lh.reap(f)(*args) alone.\n")


# --- (d) first access as programs grow ------------------------------------------------------

def _block(h, i):
    """Ten eqns with the site: three sin/tanh/cos steps."""
    h = jnp.sin(h) * 1.01 + 0.001 * i
    h = jnp.tanh(h) - 0.5 * h
    return h * jnp.cos(h) + 0.2


def straight(n: int):
    def f(x):
        h = x
        for i in range(n):
            h = lh.sow(_block(h, i), tag=T, name=f"s{i}")
        return h
    return f


def scanned(n: int, plain: bool = False):
    """All n sites in one scan body (append); the carry does not need them."""
    def f(xs):
        def body(c, xt):
            h = xt + c
            for i in range(n):
                h = _block(h, i) if plain else lh.sow(_block(h, i), tag=T, name=f"s{i}",
                                                      mode="append")
            return 0.9 * c + 0.1 * jnp.sin(xt), h
        return lax.scan(body, jnp.zeros(xs.shape[1:]), xs)[1]
    return f


def nested(n: int):
    """Jitted blocks of 10 sites, grouped by 10 in outer jits, chained."""
    def make_block(j):
        @jax.jit
        def blk(h):
            for i in range(10 * j, 10 * j + 10):
                h = lh.sow(_block(h, i), tag=T, name=f"s{i}")
            return h
        return blk

    def make_group(g):
        blocks = [make_block(j) for j in range(10 * g, min(10 * g + 10, n // 10))]

        @jax.jit
        def grp(h):
            for blk in blocks:
                h = blk(h)
            return h
        return grp

    def f(x):
        h = x
        for grp in [make_group(g) for g in range((n // 10 + 9) // 10)]:
            h = grp(h)
        return h
    return f


def count_eqns(jaxpr) -> int:
    """Eqns of `jaxpr` and of every jaxpr in its eqns' parameters."""
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    n += count_eqns(sub)
    return n


def _first_access(make, n: int, x, want, repeat: int):
    """(eqns, jit trace+lower s, reap s, first leaf 's9' s)."""
    def lower():
        traced = jax.jit(make(n)).trace(x)
        traced.lower()
        return traced.jaxpr.jaxpr

    t_lower, jaxpr = seconds(lower, repeat)
    reaps, leaves = [], []
    for _ in range(repeat):
        f = make(n)
        t0 = time.perf_counter()
        d = lh.reap(f, tag=T)(x)
        t1 = time.perf_counter()
        got = d["s9"].block_until_ready()
        reaps.append(t1 - t0)
        leaves.append(time.perf_counter() - t1)
        check_close(got, want, f"(d) {n} sites, leaf s9")
    return count_eqns(jaxpr), t_lower, statistics.median(reaps), statistics.median(leaves)


BUDGET_S = 60.  # skip a 5,000-site run estimated (5x the 1,000-site one) above this


def _d_sites() -> None:
    print("(d1) first access vs program size: n sites of 10 eqns each, x f32[4, 4]; "
          "leaf s9 (fixed depth); median of 3 at n=100, one run above")
    x = jnp.linspace(-1., 1., 16).reshape(4, 4)
    lh.reap(straight(2), tag=T)(x)["s1"]  # warm-up of the harvest machinery
    kinds = [("straight line", straight, straight(10)(x)),
             ("scan body (append)", scanned, scanned(10, plain=True)(x)),
             ("nested jax.jit", nested, nested(10)(x))]
    rows, flat = [], []
    for kind, make, want in kinds:
        per_site, spent = [], 0.
        for n in (100, 1000, 5000):
            if n == 5000 and spent * 5 > BUDGET_S:
                rows.append([kind, n, "skipped", "", "", "", "", "", "", ""])
                flat.append(f"  {kind}, {n} sites: skipped, ~{spent * 5:.0f} s "
                            f"estimated (> {BUDGET_S:.0f} s)")
                continue
            eqns, lower, reap, leaf = _first_access(make, n, x, want, 3 if n == 100 else 1)
            spent = lower + reap + leaf
            ratio = reap / lower
            per_site.append((reap / n, lower / n))
            fl = record(f"(d1) {kind}, {n} sites: first reap vs jit lower", ratio, T_FIRST)
            rows.append([kind, n, f"{eqns:,}", f"{lower:.2f}", f"{reap:.2f}", f"{leaf:.2f}",
                         f"{reap / n * 1e3:.2f}", f"{ratio:.2f}x", f"<= {T_FIRST:.1f}x", fl])
        (r0, l0), (r1, l1) = per_site[0], per_site[-1]
        flat.append(f"  {kind}: reap ms/site {r0 * 1e3:.2f} -> {r1 * 1e3:.2f} "
                    f"({r1 / r0:.2f}x); jit lower ms/site {l0 * 1e3:.2f} -> "
                    f"{l1 * 1e3:.2f} ({l1 / l0:.2f}x)")
    table(["program", "sites", "eqns", "jit lower s", "first reap s", "first leaf s",
           "reap ms/site", "reap/lower", "target", "flag"], rows)
    print("jit lower = jax.jit(f).trace(x).lower() of a fresh f (the same program); "
          "first reap = lh.reap(fresh f)(x);\nfirst leaf = then d['s9'] (slice, "
          "compile, run). eqns counts the eqns of nested jaxprs too.\nper-site time, "
          "fewest to most sites run (flat = 1.00x):")
    print("\n".join(flat) + "\n", flush=True)


# --- a small transformer (sections d and f) ---------------------------------------------------

def transformer_params(n_layers: int, d: int, seed: int = 0):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 4 * n_layers))
    return [{"wqkv": jax.random.normal(next(ks), (d, 3 * d)) / d ** 0.5,
             "wo": jax.random.normal(next(ks), (d, d)) / d ** 0.5,
             "w1": jax.random.normal(next(ks), (d, 4 * d)) / d ** 0.5,
             "w2": jax.random.normal(next(ks), (4 * d, d)) / (4 * d) ** 0.5}
            for _ in range(n_layers)]


def _norm(h):
    return (h - jnp.mean(h, -1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5)


def transformer(params, x, heads: int, site, remat: bool = False):
    """Causal pre-norm transformer on embeddings x (B, S, D). `site(name, v)`
    returns v, or v changed: called at `a{i}` (after attention) and `r{i}`
    (the residual stream after layer i). With `remat`, each layer is a
    `jax.checkpoint` (sites inside it)."""
    b, s, d = x.shape
    mask = jnp.tril(jnp.ones((s, s), bool))

    def layer(h, p, i):
        q, k, v = (t.reshape(b, s, heads, d // heads)
                   for t in jnp.split(_norm(h) @ p["wqkv"], 3, axis=-1))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
        att = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        h = site(f"a{i}", h + o @ p["wo"])
        return site(f"r{i}", h + jax.nn.gelu(_norm(h) @ p["w1"]) @ p["w2"])
    h = x
    for i, p in enumerate(params):
        h = jax.checkpoint(layer, static_argnums=2)(h, p, i) if remat else layer(h, p, i)
    return h


def tf_loss(out):
    return jnp.sum(out ** 2) / out.shape[0]


def sow_at(names):
    return lambda n, v: lh.sow(v, tag=T, name=n) if n in names else v


def perturb_at(eps):
    return lambda n, v: v + eps[n] if n in eps else v


def make_tf_loss(heads: int, site, remat: bool = False):
    """A fresh loss function object (no cache knows it)."""
    return lambda params, x: tf_loss(transformer(params, x, heads, site, remat))


def _d_transformer() -> None:
    n, d, heads, seq, batch = 24, 64, 2, 16, 4
    key = ("vjp", f"r{n - 1}")
    print(f"(d2) {n}-layer transformer (d_model {d}, {heads} heads, seq {seq}, batch "
          f"{batch}), one site per layer (r0..r{n - 1}), under jax.grad; median of 3")
    params = transformer_params(n, d)
    x = jax.random.normal(jax.random.PRNGKey(2), (batch, seq, d))
    names = {f"r{i}" for i in range(n)}
    want = jax.grad(tf_loss)(transformer(params, x, heads, lambda name, v: v))  # eager

    def lower():
        traced = jax.jit(jax.grad(make_tf_loss(heads, sow_at(names)))).trace(params, x)
        traced.lower()
        return traced.jaxpr.jaxpr

    t_lower, jaxpr = seconds(lower, 3)
    reaps = []
    for _ in range(3):
        f = jax.grad(make_tf_loss(heads, sow_at(names)))
        t0 = time.perf_counter()
        dd = lh.reap(f, tag=T)(params, x)
        reaps.append(time.perf_counter() - t0)
    leaf, got = seconds(lambda: dd[key])
    check_close(got, want, f"(d2) {key}")
    reap = statistics.median(reaps)
    ratio = reap / t_lower
    fl = record("(d2) transformer under grad: first reap vs jit lower", ratio, T_FIRST)
    table(["program", "eqns", "jit lower s", "first reap s", f"first leaf {key} s",
           "reap/lower", "target", "flag"],
          [[f"jax.grad(transformer-{n})", f"{count_eqns(jaxpr):,}", f"{t_lower:.2f}",
            f"{reap:.2f}", f"{leaf:.2f}", f"{ratio:.2f}x", f"<= {T_FIRST:.1f}x", fl]])
    print("first leaf: once (slice, compile, run); the leaf needs the whole forward "
          "pass.\n")


def recorded_stack(wrap, depth: int, reduce: bool = False, plain_wrap=lambda g: g):
    """f_0 = sin; f_i = wrap(x -> 1.1 cos f_{i-1}(x)), a site per level; and the
    same chain in plain JAX (each level wrapped by `plain_wrap`)."""
    f, plain = (lambda x: lh.sow(jnp.sin(x), tag=T, name="s0")), jnp.sin
    for i in range(1, depth + 1):
        def level(x, g=f, i=i):
            y = lh.sow(jnp.cos(g(x)) * 1.1, tag=T, name=f"s{i}")
            return jnp.sum(y) if reduce else y

        def plain_level(x, g=plain):
            y = jnp.cos(g(x)) * 1.1
            return jnp.sum(y) if reduce else y
        f, plain = wrap(level), plain_wrap(plain_level)
    return f, plain


def _d_recorded() -> None:
    rows = []
    for kind, depth in (("jit", 20), ("vmap", 8), ("grad", 5)):
        wrap = {"jit": lh.jit, "vmap": lh.vmap, "grad": lh.grad}[kind]
        x = jnp.full((2,) * depth, 0.3) if kind == "vmap" else jnp.float32(0.3)
        key = ("grad", f"s{depth}") if kind == "grad" else f"s{depth}"
        if kind == "grad":  # s_depth is under the outermost grad only
            _, inner = recorded_stack(lh.grad, depth - 1, reduce=True, plain_wrap=jax.grad)
            want = jax.grad(lambda x: jnp.cos(inner(x)) * 1.1)(x)
        else:
            want = recorded_stack(lambda g: g, depth)[1](x)
        stacks = [recorded_stack(wrap, depth, reduce=kind == "grad")[0] for _ in range(3)]
        reaps = []
        for f in stacks:
            t0 = time.perf_counter()
            d = lh.reap(f, tag=T)(x)
            reaps.append(time.perf_counter() - t0)
        leaf, got = seconds(lambda: d[key])
        check_close(got, want, f"(d3) {depth} nested lh.{kind}, leaf {key}")
        reap = statistics.median(reaps)
        fl = record(f"(d3) {depth} nested lh.{kind}: reap seconds", reap, T_NESTED_S, " s")
        rows.append([f"{depth} nested lh.{kind}", f"{reap:.3f}", f"< {T_NESTED_S:.0f} s", fl,
                     str(key), f"{leaf:.2f}"])
    print("(d3) nested recorded transforms, one site per level; reap: median of 3 "
          "fresh stacks")
    table(["program", "reap s", "target", "flag", "leaf", "first leaf s"], rows)


def _d_per_example() -> None:
    n, width, batch = 16, 128, 16
    params, _ = mlp_params(n, width, 1)
    xs = jax.random.normal(jax.random.PRNGKey(3), (batch, width))

    def make_loss():
        def loss(params, x):
            h = x
            for w, b in params:
                h = jnp.tanh(h @ w + b)
            return lh.sow(jnp.mean(h ** 2), tag=T, name="loss")
        return loss

    def lazy():
        f = lh.vmap(lh.grad(make_loss()), in_axes=(None, 0))
        return lh.reap(f, tag=T)(params, xs)["grad", "loss"]

    hand = lambda: jax.jit(jax.vmap(jax.grad(make_loss()), in_axes=(None, 0)))(params, xs)
    check_close(lazy(), hand(), "(d4) per-example gradients")
    t = time_interleaved({"lazy": lazy, "hand": lambda: block(hand())}, number=1, repeat=3,
                         warmup=0)
    ratio = t["lazy"] / t["hand"]
    fl = record("(d4) per-example grads lh.vmap(lh.grad): first leaf vs jit", ratio, T_FIRST)
    print(f"(d4) per-example gradients, {n}-layer MLP (width {width}, {batch} examples); "
          "fresh loss each time, median of 3")
    table(["program", "first leaf s", "jit first call s", "ratio", "target", "flag"],
          [["lh.vmap(lh.grad(loss)) [('grad', 'loss')]", f"{t['lazy']:.3f}",
            f"{t['hand']:.3f}", f"{ratio:.2f}x", f"<= {T_FIRST:.1f}x", fl]])
    print("lazy = lh.reap(lh.vmap(lh.grad(loss), in_axes=(None, 0)))(params, xs)"
          "['grad', 'loss'] to the value;\nhand = jax.jit(jax.vmap(jax.grad(loss), "
          "in_axes=(None, 0)))(params, xs), first call.\n")


def section_d() -> None:
    _d_sites()
    _d_transformer()
    _d_recorded()
    _d_per_example()


# --- (e) one leaf inside a while_loop ---------------------------------------------------------

ITER = 20


def while_model(c0, big0, w):
    """A cheap carry `c` (the site) and an expensive one `big` it does not need."""
    def body(carry):
        i, c, big = carry
        c = lh.sow(jnp.sin(c) * 0.9 + 0.1, tag=T, name="c", mode="clobber")
        return i + 1, c, jnp.tanh(big @ w)
    _, c, big = lax.while_loop(lambda cr: cr[0] < ITER, body, (0, c0, big0))
    return jnp.sum(c) + jnp.sum(big)


def hand_while(c0, big0, w):
    """Hand-written slice: the cheap carry alone."""
    body = lambda cr: (cr[0] + 1, jnp.sin(cr[1]) * 0.9 + 0.1)
    return lax.while_loop(lambda cr: cr[0] < ITER, body, (0, c0))[1]


def _mem(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {"args": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "temps": m.temp_size_in_bytes}
    out["total"] = sum(out.values()) - m.alias_size_in_bytes
    return out


def section_e() -> None:
    width = 256
    print(f"(e) leaf 'c' of a while_loop ({ITER} iterations): carry c f32[{width}] "
          f"(the site) and big f32[{width},{width}] = tanh(big @ w) (not needed)")
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    args = (jax.random.normal(ks[0], (width,)), jax.random.normal(ks[1], (width, width)),
            jax.random.normal(ks[2], (width, width)) / width ** 0.5)
    reaped = lh.reap(while_model, tag=T)
    hand, whole = jax.jit(hand_while), jax.jit(while_model)
    check_close(reaped(*args)["c"], hand(*args), "(e) leaf c")
    block(whole(*args))
    before = COMPILES.count
    t = time_interleaved({"lazy": lambda: reaped(*args)["c"].block_until_ready(),
                          "hand": lambda: hand(*args).block_until_ready()},
                         number=100, repeat=7, warmup=5)
    t |= time_interleaved({"whole": lambda: whole(*args).block_until_ready()},
                          number=3, repeat=3, warmup=1)
    assert COMPILES.count == before, "(e): a timed call compiled"
    mem = {"lazy": _mem(reaped(*args).lower("c").compile()),
           "hand": _mem(hand.lower(*args).compile()),
           "whole": _mem(whole.lower(*args).compile())}
    rt, rm = t["lazy"] / t["hand"], mem["lazy"]["total"] / mem["hand"]["total"]
    flags = {"lazy": (f"<= {T_LOOP:.2f}x", record("(e) while_loop leaf: time", rt, T_LOOP),
                      f"<= {T_MEM:.2f}x", record("(e) while_loop leaf: memory", rm, T_MEM)),
             "hand": ("", "", "", ""), "whole": ("(info)", "", "(info)", "")}
    names = {"lazy": "lazy d['c']", "hand": "hand-written slice",
             "whole": "whole program"}
    table(["program", "µs/call", "ratio", "target", "flag", "args", "outputs", "temps",
           "total", "ratio", "target", "flag"],
          [[names[k], fmt_us(t[k]), f"{t[k] / t['hand']:.2f}x", flags[k][0], flags[k][1],
            *[fmt_bytes(mem[k][c]) for c in ("args", "outputs", "temps", "total")],
            f"{mem[k]['total'] / mem['hand']['total']:.2f}x", flags[k][2], flags[k][3]]
           for k in names])
    print("memory from memory_analysis() of d.lower('c').compile() and of the jitted "
          "hand-written slice;\ntotal = args + outputs + temps - aliased; whole = "
          "jax.jit(while_model) (what no slicing would cost).\n")


# --- (f) training step with activation gradients ----------------------------------------------

def _linen_model(params, heads: int):
    """A Flax linen version of `transformer` (params p0, p1, ... in flat order)
    with `self.perturb` at every site; None if Flax is not installed."""
    try:
        import flax.linen as nn
    except ImportError:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(params)

    class LinenTransformer(nn.Module):
        @nn.compact
        def __call__(self, x):
            ps = [self.param(f"p{j}", nn.initializers.zeros, leaf.shape)
                  for j, leaf in enumerate(leaves)]
            return transformer(jax.tree_util.tree_unflatten(treedef, ps), x, heads,
                               lambda n, v: self.perturb(n, v))

    return LinenTransformer(), treedef


def make_steps(params, heads: int, names: list, remat: bool = False) -> dict:
    """Factories of fresh training steps `(params, x) -> (loss, param grads,
    leaves)`; the activation gradients are `leaves` or `leaves["vjp"]`. With
    `remat`, every layer is checkpointed (no Flax step then)."""
    def hand():
        def step(p, x):
            eps = {n: jnp.zeros(x.shape) for n in names}
            loss = lambda p, e: tf_loss(transformer(p, x, heads, perturb_at(e), remat))
            v, (g, ge) = jax.value_and_grad(loss, argnums=(0, 1))(p, eps)
            return v, g, ge
        return step

    def reap():
        def loss(p, x):
            out = transformer(lh.sow(p, tag=T, name="params"), x, heads, sow_at(names),
                              remat)
            return lh.sow(tf_loss(out), tag=T, name="loss")

        def step(p, x):
            d = lh.reap(jax.value_and_grad(loss), tag=T)(p, x)
            out = d.compute("loss", ("vjp", "params"), *[("vjp", n) for n in names])
            return out["loss"], out["vjp"]["params"], {"vjp": out["vjp"]}
        return step

    def car():
        def step(p, x):
            loss = make_tf_loss(heads, sow_at(names), remat)
            (v, g), d = lh.call_and_reap(jax.value_and_grad(loss), tag=T)(p, x)
            return v, g, d.compute()
        return step

    steps = {"(1) hand-written perturbation": hand, "(2) lh.reap(value_and_grad)": reap,
             "(3) lh.call_and_reap + compute": car}
    linen = None if remat else _linen_model(params, heads)
    if linen is not None:
        model, treedef = linen

        def flax():
            def step(p, x):
                lp = {f"p{j}": v for j, v in enumerate(jax.tree_util.tree_leaves(p))}
                eps = {n: jnp.zeros(x.shape) for n in names}
                loss = lambda lp, e: tf_loss(model.apply({"params": lp, "perturbations": e}, x))
                v, (g, ge) = jax.value_and_grad(loss, argnums=(0, 1))(lp, eps)
                return v, jax.tree_util.tree_unflatten(treedef, [g[f"p{j}"] for j in
                                                                 range(len(g))]), ge
            return step
        steps["(4) Flax linen perturb"] = flax
    return steps


def _act_grads(out, names):
    leaves = out[2].get("vjp", out[2])
    return {n: leaves[n] for n in names}


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


STEP = dict(n=6, d=128, heads=4, seq=64, batch=8)  # the training step of (f) and (g)
FIRST_ROUNDS = 3  # first calls per step in (f), (f2): one is as noisy as the machine


def step_model():
    """(site names, params, x, heads) of the (f)/(g) transformer."""
    n, d, heads, seq, batch = (STEP[k] for k in ("n", "d", "heads", "seq", "batch"))
    names = [f"{k}{i}" for i in range(n) for k in ("a", "r")]
    params = transformer_params(n, d, seed=5)
    x = jax.random.normal(jax.random.PRNGKey(6), (batch, seq, d))
    return names, params, x, heads


def section_f() -> None:
    _training_step("f")


def section_f2() -> None:
    _training_step("f2", remat=True)


def _training_step(section: str, remat: bool = False) -> None:
    names, params, x, heads = step_model()
    print(f"({section}) jitted training step: loss, parameter gradients and the {len(names)} "
          f"activation gradients of a {STEP['n']}-layer transformer\n    (d_model "
          f"{STEP['d']}, {heads} heads, seq {STEP['seq']}, batch {STEP['batch']}); sites "
          f"a{{i}} (after attention), r{{i}} (after the MLP)"
          + ("; every layer a jax.checkpoint (jax_remat3 "
             f"{'on' if jax.config.values.get('jax_remat3') else 'off'})" if remat else ""))
    steps = make_steps(params, heads, names, remat)
    if len(steps) < 4 and not remat:
        print("    Flax is not installed: (4) skipped")
    tiny = transformer_params(1, 16)  # warms every path up, so (1) pays no first-use cost
    for make in make_steps(tiny, 2, ["a0", "r0"], remat).values():
        block(jax.jit(make())(tiny, x[:1, :4, :16]))
    compiled, firsts, want = {}, {k: [] for k in steps}, None
    for rnd in range(FIRST_ROUNDS):  # first calls of fresh steps, round-robin
        for name, make in steps.items():
            before = COMPILES.count
            t0 = time.perf_counter()
            fresh = jax.jit(make()).lower(params, x).compile()
            got = block(fresh(params, x))
            firsts[name].append(time.perf_counter() - t0)
            assert COMPILES.count > before, f"({section}) {name}: first call did not compile"
            if rnd:
                continue
            compiled[name] = fresh  # (checked before anything else is timed)
            want = got if want is None else want
            check_close(got[:2], want[:2], f"({section}) {name}: loss and parameter gradients")
            check_close(_act_grads(got, names), want[2],
                        f"({section}) {name}: activation gradients")
    first = {k: statistics.median(v) for k, v in firsts.items()}
    t = time_interleaved({k: (lambda c=c: block(c(params, x))) for k, c in compiled.items()},
                         number=2, repeat=5, warmup=2)
    ref = next(iter(steps))
    flops = {k: _flops(c) for k, c in compiled.items()}
    rows = []
    for k in steps:
        rs, rf, rg = t[k] / t[ref], first[k] / first[ref], flops[k] / flops[ref]
        fl = ["", "", ""] if k == ref else [
            record(f"({section}) {k}: steady", rs, T_STEP),
            record(f"({section}) {k}: first call", rf, T_STEP_FIRST),
            record(f"({section}) {k}: FLOPs", rg, 1.0)]
        rows.append([k, fmt_ms(t[k]), f"{rs:.2f}x", fl[0], f"{first[k]:.2f}", f"{rf:.2f}x",
                     fl[1], f"{flops[k] / 1e9:.3f}", f"{rg:.3f}x", fl[2]])
    table(["step", "steady ms", f"ratio (<= {T_STEP}x)", "flag", "first call s",
           f"ratio (<= {T_STEP_FIRST}x)", "flag", "GFLOP", "ratio (same)", "flag"], rows)
    print("steady = a call of the compiled step; first call = jax.jit(fresh step)"
          f".lower().compile() + one call, median of {FIRST_ROUNDS}\nrounds over the "
          "steps in turn (the first round's values are checked against (1) before "
          "anything\nelse is timed); GFLOP from cost_analysis() of that compiled step.\n")


# --- (g) eager call_and_reap in a training loop -------------------------------------------

class _ProgramsRun:
    """The compiled programs lazyharvest runs (and their arguments) while on."""

    def __init__(self):
        self.runs: list = []
        self._original = None

    def __enter__(self):
        from lazyharvest import program
        self._original = program.Program.__call__
        runs, original = self.runs, self._original

        def call(prog, *flat):
            runs.append((prog, flat))
            return original(prog, *flat)
        program.Program.__call__ = call
        return self

    def __exit__(self, *exc):
        from lazyharvest import program
        program.Program.__call__ = self._original


def section_g() -> None:
    names, params, x, heads = step_model()
    print(f"(g) eager training step (no jax.jit around it): "
          f"lh.call_and_reap(jax.value_and_grad(loss)) then d.compute() of the {len(names)} "
          f"activation gradients\n    of the (f) transformer, steady state (the same "
          f"leaves read every step) vs the jitted perturbation trick called eagerly")
    loss = make_tf_loss(heads, sow_at(names))
    car = lh.call_and_reap(jax.value_and_grad(loss), tag=T)
    hand = jax.jit(make_steps(params, heads, names)["(1) hand-written perturbation"]())

    def lazy():
        out, dd = car(params, x)
        return out, dd.compute(*[("vjp", k) for k in names])["vjp"]

    want = block(hand(params, x))
    for _ in range(2):  # the first step reads the leaves, the second returns them
        got = block(lazy())
    check_close(got[0], want[:2], "(g) loss and parameter gradients")
    check_close(got[1], want[2], "(g) activation gradients")
    before = COMPILES.count
    with _ProgramsRun() as seen:
        block(lazy())
    assert COMPILES.count == before, "(g): a steady step compiled"
    flops_lazy = sum(_flops(p.fn.lower(*flat).compile()) for p, flat in seen.runs)
    flops_hand = _flops(hand.lower(params, x).compile())
    t = time_interleaved({"lazy": lambda: block(lazy()), "hand": lambda: block(hand(params, x))},
                         number=2, repeat=7, warmup=2)
    r, rf = t["lazy"] / t["hand"], flops_lazy / flops_hand
    table(["step", "steady ms", "programs run", "GFLOP", "ratio", "target", "flag"], [
        ["perturbation trick (jitted, called eagerly)", fmt_ms(t["hand"]), 1,
         f"{flops_hand / 1e9:.3f}", "", "", ""],
        ["call_and_reap + compute (eager)", fmt_ms(t["lazy"]), len(seen.runs),
         f"{flops_lazy / 1e9:.3f}", f"{r:.2f}x", f"<= {T_LOOP}x",
         record("(g) eager call_and_reap + compute: steady", r, T_LOOP)],
        ["", "", "", "", f"{rf:.3f}x FLOPs", "same", record("(g) eager: FLOPs", rf, 1.0)]])
    print("programs run = compiled programs one steady step runs; GFLOP from "
          "cost_analysis() of each, summed.\n")


# --- main ---------------------------------------------------------------------------------------

def summary() -> None:
    """Prints the measurements above their target, if any."""
    above = [(w, v, t, u) for w, v, t, u in RESULTS if v > t]
    if not above:
        print(f"all {len(RESULTS)} measurements within target")
    for w, v, t, u in above:
        shown = f"{v:.2f}{u} > {t:.2f}{u}" if u in ("x", " s") else f"{v:,.1f}{u} > {t:g}{u}"
        print(f"  ABOVE  {w}: {shown}")
    if above:
        print(f"{len(above)} of {len(RESULTS)} measurements above target")
    sys.stdout.flush()


SECTIONS = {"a": section_a, "a2": section_a2, "b": section_b, "c": section_c, "d": section_d,
            "e": section_e, "f": section_f, "f2": section_f2, "g": section_g}
PARTS = {"d1": _d_sites, "d2": _d_transformer, "d3": _d_recorded, "d4": _d_per_example}


def main(argv: list[str]) -> None:
    chosen = argv or list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS and s not in PARTS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from "
                         f"{list(SECTIONS) + list(PARTS)}")
    header("loops.py: loops, per-call overhead, scaling and training steps vs "
           "hand-written JAX")
    for s in chosen:
        t0 = time.perf_counter()
        {**SECTIONS, **PARTS}[s]()
        print(f"[section ({s}): {time.perf_counter() - t0:.1f} s]\n", flush=True)
    summary()


if __name__ == "__main__":
    main(sys.argv[1:])
