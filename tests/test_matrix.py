"""Every higher-order primitive x every JAX transform around the harvest.

Each case comes with an independent plain-JAX oracle `hand(x, eps, plants)`:
the same computation written without sites, where `plants[name]` replaces a
site's value and `eps[name]` is added to it. Values, cotangents (the gradient
w.r.t. `eps`), tangents and plants are all checked against it.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import lazyharvest as lh
from helpers import close

sow = lh.sow


def site(v, name, eps, plants, mode="strict"):
    """The oracle's version of a site: planted, then perturbed."""
    if plants and name in plants:
        v = jnp.broadcast_to(plants[name], jnp.shape(v)).astype(v.dtype)
    if eps and name in eps:
        v = v + eps[name]
    return v


# --- cases: (function with sites, oracle, names, supports reverse mode) --------

def scan_f(x):
    def body(c, v):
        y = sow(jnp.sin(v) * c, tag="t", name="ys", mode="append")
        c = sow(c + y, tag="t", name="c", mode="clobber")
        return c, y
    c, ys = lax.scan(body, 1., x)
    return c + jnp.sum(ys ** 2)


def scan_hand(x, eps=None, plants=None):
    c, ys, vals = 1., [], {"ys": []}
    for i in range(x.shape[0]):
        e = None if eps is None else {"ys": eps["ys"][i], "c": 0.}
        p = None if plants is None or "ys" not in plants else {"ys": plants["ys"][i]}
        y = site(jnp.sin(x[i]) * c, "ys", e, p)
        vals["ys"].append(y)
        c = site(c + y, "c", None, plants)
        ys.append(y)
    c = c + (0. if eps is None else eps["c"])  # only the last clobber value is seen
    vals = {"ys": jnp.stack(vals["ys"]), "c": c}
    return c + jnp.sum(jnp.stack(ys) ** 2), vals


def cond_f(x):
    y = lax.cond(jnp.sum(x) > 0, lambda v: sow(v * 2., tag="t", name="b"),
                 lambda v: sow(v - 1., tag="t", name="b"), x)
    return jnp.sum(jnp.tanh(y))


def cond_hand(x, eps=None, plants=None):
    b = site(jnp.where(jnp.sum(x) > 0, x * 2., x - 1.), "b", eps, plants)
    return jnp.sum(jnp.tanh(b)), {"b": b}


def while_f(x):
    def body(s):
        i, v = s
        return i + 1, sow(v * 1.5, tag="t", name="w", mode="clobber")
    return jnp.sum(lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1])


def while_hand(x, eps=None, plants=None):
    v = x
    for _ in range(3):
        v = site(v * 1.5, "w", None, plants)
    w = v + (0. if eps is None else eps["w"])
    return jnp.sum(v), {"w": w}


def remat_jit_f(x):
    y = jax.checkpoint(lambda v: sow(jnp.sin(v), tag="t", name="r"))(x)
    z = jax.jit(lambda v: sow(v * 3., tag="t", name="j"))(y)
    sow(jnp.cos(x), tag="t", name="unused")
    return jnp.sum(z * y)


def remat_jit_hand(x, eps=None, plants=None):
    r = site(jnp.sin(x), "r", eps, plants)
    j = site(r * 3., "j", eps, plants)
    unused = site(jnp.cos(x), "unused", eps, plants)
    return jnp.sum(j * r), {"r": r, "j": j, "unused": unused}


CASES = {
    "scan": (scan_f, scan_hand, True),
    "cond": (cond_f, cond_hand, True),
    "while": (while_f, while_hand, False),
    "remat_jit": (remat_jit_f, remat_jit_hand, True),
}
X = jnp.array([0.4, -0.3, 0.9])
XS = jnp.stack([X, -X * 0.5])


def eps_like(sites):
    return jax.tree_util.tree_map(jnp.zeros_like, sites)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("wrap", ["plain", "jit", "jit_jit"])
def test_values(case, wrap):
    f, hand, _ = CASES[case]
    g = {"plain": f, "jit": jax.jit(f), "jit_jit": jax.jit(jax.jit(f))}[wrap]
    out, d = lh.call_and_reap(g, tag="t")(X)
    h_out, h_sites = hand(X)
    close(out, h_out, rtol=1e-5)
    close(d.compute(), h_sites, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("wrap", ["vmap", "jit_vmap", "vmap_jit"])
def test_values_under_vmap(case, wrap):
    f, hand, _ = CASES[case]
    g = {"vmap": jax.vmap(f), "jit_vmap": jax.jit(jax.vmap(f)),
         "vmap_jit": jax.vmap(jax.jit(f))}[wrap]
    d = lh.reap(g, tag="t")(XS)
    expected = jax.vmap(lambda x: hand(x)[1])(XS)
    if "ys" in expected:  # plain jax.vmap: append sites are (length, batch)
        expected["ys"] = expected["ys"].T
    close(d.compute(), expected, rtol=1e-5)
    # and with lh.vmap the law holds exactly
    d = lh.reap(lh.vmap(f), tag="t")(XS)
    close(d.compute(), jax.vmap(lambda x: hand(x)[1])(XS), rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
@pytest.mark.parametrize("wrap", ["grad", "grad_jit", "jit_grad"])
def test_cotangents(case, wrap):
    f, hand, _ = CASES[case]
    g = {"grad": jax.grad(f), "grad_jit": jax.grad(jax.jit(f)),
         "jit_grad": jax.jit(jax.grad(f))}[wrap]
    d = lh.reap(g, tag="t")(X)
    h_out, h_sites = hand(X)
    cts = jax.grad(lambda e: hand(X, eps=e)[0])(eps_like(h_sites))
    got = d.compute()
    close({k: got[k] for k in h_sites}, h_sites, rtol=1e-5)
    close(got["vjp"], cts, rtol=1e-4, atol=1e-5)
    close(jax.grad(f)(X), jax.grad(lambda x: hand(x)[0])(X), rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("wrap", ["jvp", "jit_jvp"])
def test_tangents(case, wrap):
    f, hand, _ = CASES[case]
    t = jnp.array([1., -2., 0.5])
    jvp = lambda x: jax.jvp(f, (x,), (t,))
    d = lh.reap(jvp if wrap == "jvp" else jax.jit(jvp), tag="t")(X)
    expected = jax.jvp(lambda x: hand(x)[1], (X,), (t,))[1]
    got = d.compute()
    # a clobber site of a while loop/scan has the tangent of its last value
    close(got["jvp"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_plant_and_harvest(case):
    f, hand, _ = CASES[case]
    _, h_sites = hand(X)
    for name, value in h_sites.items():
        plant_value = jnp.full_like(value, 0.25)
        expected_out, expected_sites = hand(X, plants={name: plant_value})
        close(lh.plant(f, tag="t")({name: plant_value}, X), expected_out, rtol=1e-5)
        out, d = lh.harvest(f, tag="t")({name: plant_value}, X)
        assert name not in d
        close(out, expected_out, rtol=1e-5)
        close(d.compute(), {k: v for k, v in expected_sites.items() if k != name},
              rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_grad_of_plant_and_reap(case):
    f, hand, _ = CASES[case]
    _, h_sites = hand(X)
    name = sorted(h_sites)[0]
    p = jnp.full_like(h_sites[name], 0.25)
    close(jax.grad(lambda x: lh.plant(f, tag="t")({name: p}, x))(X),
          jax.grad(lambda x: hand(x, plants={name: p})[0])(X), rtol=1e-4, atol=1e-6)
    close(jax.grad(lambda x: jnp.sum(lh.reap(f, tag="t")(x)[name]))(X),
          jax.grad(lambda x: jnp.sum(hand(x)[1][name]))(X), rtol=1e-4, atol=1e-6)
