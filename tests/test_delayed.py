"""DelayedDict: laziness, sharing, caching, tracing, threads, lifetime (SPEC 4)."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from helpers import CompileCounter, close

sow = lh.sow
COMPILES = CompileCounter()


def mlp(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = sow(jnp.tanh(h @ w + b), tag="act", name=f"h{i}")
    return jnp.sum(h)


def make_params(n, width=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    return [(jax.random.normal(k, (width, width)) * 0.3, jnp.full(width, 0.1)) for k in keys]


def hand_acts(params, x):
    acts, h = [], x
    for w, b in params:
        h = jnp.tanh(h @ w + b)
        acts.append(h)
    return acts


P4 = make_params(4)
X = jnp.linspace(-1, 1, 16).reshape(2, 8)


def test_keys_len_in_avals_compile_nothing():
    before = COMPILES.count
    d = lh.reap(mlp, tag="act")(P4, X)
    assert list(d.keys()) == ["h0", "h1", "h2", "h3"]
    assert len(d) == 4 and "h2" in d and "h9" not in d
    assert d.avals["h1"].shape == (2, 8)
    assert COMPILES.count == before


def test_leaf_compiles_only_its_slice():
    d = lh.reap(mlp, tag="act")(P4, X)
    text = d.lower("h1").as_text()
    # two layers: two dot products; none for layers 2 and 3
    assert text.count("dot_general") == 2
    close(d["h1"], hand_acts(P4, X)[1])


def test_second_call_same_shapes_compiles_nothing():
    g = lh.reap(mlp, tag="act")
    g(P4, X)["h2"]
    g(P4, X).compute("h0", "h3")
    p2, x2 = make_params(4, seed=1), X * 2
    before = COMPILES.count
    d = g(p2, x2)
    h2 = d["h2"]
    d.compute("h0", "h3")
    assert COMPILES.count == before
    close(h2, hand_acts(p2, x2)[2])


def test_compute_is_one_program_and_equals_one_by_one():
    p3 = make_params(4, seed=3)
    d = lh.reap(mlp, tag="act")(p3, X)
    before = COMPILES.count
    out = d.compute("h0", "h2", "h3")
    assert COMPILES.count == before + 1
    d2 = lh.reap(mlp, tag="act")(p3, X)
    for k in ("h0", "h2", "h3"):
        close(out[k], d2[k])
    assert set(d.compute()) == {"h0", "h1", "h2", "h3"}


def test_memoized_and_aliases_share_one_object():
    d = lh.reap(mlp, tag="act")(P4, X)
    assert d["h1"] is d["h1"]
    assert d.thunk("h1")() is d["h1"]
    assert d.is_computed("h1") and not d.is_computed("h2")
    f = lambda x: sow(x ** 3, tag="t", name="x3") + 1
    dv = lh.reap(lh.jit(lh.vmap(lh.grad(f))), tag="t")(jnp.array([2., 3.]))
    assert dv["grad", "vmap", "x3"] is dv["grad", "vmap", "jit", "x3"] is dv["grad", "x3"]


def test_sub_views_and_nested_compute():
    f = lambda x: sow(x ** 3, tag="t", name="x3") + 1
    d = lh.reap(jax.grad(f), tag="t")(2.)
    assert list(d["vjp"].keys()) == ["x3"]
    close(d["vjp"]["x3"], 1.)
    out = d.compute()
    assert set(out) == {"x3", "vjp"} and set(out["vjp"]) == {"x3"}
    close(d.compute("vjp"), {"vjp": {"x3": 1.}})


def test_continuation():
    d = lh.reap(mlp, tag="act")(P4, X)
    fn = d.fn("h2")
    p2 = make_params(4, seed=5)
    close(fn(p2, X), hand_acts(p2, X)[2])
    with pytest.raises(lh.HarvestError, match="shaped like"):
        fn(P4, jnp.ones((3, 8)))


def test_inside_jit_forced_leaves_are_staged_unforced_cost_nothing():
    def g(params, x):
        d = lh.reap(mlp, tag="act")(params, x)
        return d["h1"]
    jaxpr = jax.make_jaxpr(g)(P4, X)
    text = str(jaxpr)
    assert text.count("dot_general") == 2  # only h1's slice was staged
    close(jax.jit(g)(P4, X), hand_acts(P4, X)[1])


def test_inside_grad_and_vmap():
    def loss(params, x):
        return jnp.sum(lh.reap(mlp, tag="act")(params, x)["h2"] ** 2)
    hand = lambda p, x: jnp.sum(hand_acts(p, x)[2] ** 2)
    close(jax.grad(loss)(P4, X), jax.grad(hand)(P4, X), rtol=1e-4)
    xs = jnp.stack([X, X * 2])
    close(jax.vmap(lambda x: lh.reap(mlp, tag="act")(P4, x)["h0"])(xs),
          jax.vmap(lambda x: hand_acts(P4, x)[0])(xs))


def test_repr_shows_pending_and_values():
    f = lambda x: sow(x ** 3, tag="t", name="x3") + 1
    d = lh.reap(lh.grad(f), tag="t")(2.)
    assert repr(d) == "DelayedDict({'x3': <pending f32[]>, 'grad': {'x3': <pending f32[]>}})"
    d["x3"]
    assert repr(d) == "DelayedDict({'x3': 8.0, 'grad': {'x3': <pending f32[]>}})"


def test_threads_force_one_leaf_once(monkeypatch):
    from lazyharvest.program import Program
    d = lh.reap(mlp, tag="act")(make_params(4, seed=7), X)
    calls = {"n": 0}
    original = Program.__call__

    def counting(self, *a):
        calls["n"] += 1
        return original(self, *a)
    monkeypatch.setattr(Program, "__call__", counting)
    results = [None] * 8
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        results[i] = d["h3"]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls["n"] == 1
    assert all(r is results[0] for r in results)


def test_lifetime_function_and_arrays_are_not_kept_alive():
    def make():
        def fresh(params, x):
            return mlp(params, x)
        return fresh
    fn = make()
    x = jnp.ones((2, 8)) * 0.5
    fn_ref, x_ref = weakref.ref(fn), weakref.ref(x)
    d = lh.reap(fn, tag="act")(P4, x)
    d["h1"]
    d.compute()
    del d, fn, x
    gc.collect()
    assert fn_ref() is None
    assert x_ref() is None


def test_dict_equality_with_plain_mapping():
    f = lambda x: sow(x ** 3, tag="t", name="x3") + 1
    d = lh.reap(jax.grad(f), tag="t")(2.)
    assert {k: float(v) for k, v in d.items()} == {"x3": 8., ("vjp", "x3"): 1.}
