"""Interventions: plants that are functions of the sown value (issue 35, part
1; docs/semantics.md section 5a). Each workflow is one call with no prior
reap, checked against the program written by hand with the intervention in
place (plain JAX)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lazyharvest as lh
from helpers import CompileCounter, close

L, T, D, V = 3, 5, 4, 7  # layers, positions, width, vocabulary
KEY = jax.random.key(0)
K1, K2, K3, K4 = jax.random.split(KEY, 4)
PARAMS = {
    "embed": jax.random.normal(K1, (V, D)) * 0.5,
    "mix": jax.random.normal(K2, (L, T, T)) * 0.3,  # attention-like mixing of positions
    "w": jax.random.normal(K3, (L, D, D)) * 0.4,
    "out": jax.random.normal(K4, (D, V)) * 0.5,
}
TOKENS = jnp.array([1, 4, 2, 6, 3])
CORRUPT = jnp.array([1, 4, 5, 6, 3])


def layer(p, i, h):
    return h + jnp.tanh(p["mix"][i] @ h @ p["w"][i])


def model(p, tokens, edit=None):
    """A small residual stack; `edit(i, h)` is the hand-written intervention
    at layer i's output (None: the site)."""
    h = p["embed"][tokens]
    for i in range(L):
        h = layer(p, i, h)
        h = lh.sow(h, tag="t", name=f"h{i}") if edit is None else edit(i, h)
    return h @ p["out"]


def plant(plants, tokens=TOKENS, **kw):
    return lh.plant(model, tag="t", **kw)(plants, PARAMS, tokens)


# --- ablation and patching ------------------------------------------------------

def zero_pos(h, pos=2):
    return h.at[pos].set(0.0)


def test_zero_and_mean_ablation_of_one_position():
    close(plant({"h1": zero_pos}),
          model(PARAMS, TOKENS, lambda i, h: zero_pos(h) if i == 1 else h))
    mean = lambda h: h.at[2].set(h.mean(0))  # noqa: E731
    close(plant({"h1": mean}),
          model(PARAMS, TOKENS, lambda i, h: mean(h) if i == 1 else h))


def test_patching_one_position_from_a_clean_run():
    clean = lh.reap(model, tag="t")(PARAMS, TOKENS)["h1"]
    patch = lambda h, src: h.at[2].set(src[2])  # noqa: E731
    got = plant({"h1": lh.intervention(patch, clean)}, CORRUPT)
    close(got, model(PARAMS, CORRUPT, lambda i, h: patch(h, clean) if i == 1 else h))
    # (the clean activation really differs from the corrupted run's)
    assert not np.allclose(got, model(PARAMS, CORRUPT, lambda i, h: h))


def test_directional_ablation_at_every_layer():
    r = jnp.array([1.0, -2.0, 0.5, 1.0])
    r = r / jnp.linalg.norm(r)
    project_out = lambda h, r: h - jnp.outer(h @ r, r)  # noqa: E731
    plants = {f"h{i}": lh.intervention(project_out, r) for i in range(L)}
    close(plant(plants), model(PARAMS, TOKENS, lambda i, h: project_out(h, r)))


def test_added_intervention_and_gradient_of_the_intervened_program():
    steer = jnp.arange(D, dtype=jnp.float32) * 0.1
    add_at_end = lambda h, v: jnp.zeros_like(h).at[-1].set(v)  # noqa: E731
    got = plant({"h0": lh.intervention(add_at_end, steer)}, mode="add")
    want = model(PARAMS, TOKENS, lambda i, h: h.at[-1].add(steer) if i == 0 else h)
    close(got, want)

    def loss(p, edit=None):
        return jnp.sum(model(p, TOKENS, edit) ** 2)
    g = jax.grad(lambda p: jnp.sum(lh.plant(model, tag="t")(
        {"h1": zero_pos}, p, TOKENS) ** 2))(PARAMS)
    close(g, jax.grad(loss)(PARAMS, lambda i, h: zero_pos(h) if i == 1 else h), rtol=1e-4)


def test_sae_feature_clamp():
    enc = jax.random.normal(K1, (D, 6)) * 0.5
    dec = jax.random.normal(K2, (6, D)) * 0.5

    def clamp(h, enc, dec, value):
        f = jax.nn.relu(h @ enc)
        return h + (f.at[:, 3].set(value) - f) @ dec
    got = plant({"h2": lh.intervention(clamp, enc, dec, 4.0)})
    close(got, model(PARAMS, TOKENS, lambda i, h: clamp(h, enc, dec, 4.0) if i == 2 else h))


# --- a sweep compiles once, and runs as one vmap -----------------------------------

def patch_at(h, src, pos, on):
    """Position `pos` from `src` where `on` (this layer is the swept one)."""
    return jnp.where(on, h.at[pos].set(src[pos]), h)


def test_a_layer_position_patching_sweep_compiles_once_and_vmaps():
    clean = lh.reap(model, tag="t")(PARAMS, TOKENS)
    f = jax.jit(lambda layer_, pos: lh.plant(model, tag="t")(
        {f"h{i}": lh.intervention(patch_at, clean[f"h{i}"], pos, layer_ == i) for i in range(L)},
        PARAMS, CORRUPT))
    want = {(i, pos): model(PARAMS, CORRUPT, lambda j, h, i=i, pos=pos: (
        h.at[pos].set(clean[f"h{j}"][pos]) if j == i else h)) for i in range(L) for pos in range(T)}
    f(0, 0)
    counter = CompileCounter()
    for (i, pos), w in want.items():
        close(f(i, pos), w)
    assert counter.count == 0  # 15 calls, no compile after the first
    layers, positions = jnp.meshgrid(jnp.arange(L), jnp.arange(T), indexing="ij")
    swept = jax.vmap(f)(layers.ravel(), positions.ravel())
    close(swept, jnp.stack([want[i, p] for i in range(L) for p in range(T)]))


def blend_at(h, src, pos, alpha, on):
    return jnp.where(on, h.at[pos].set(alpha * src[pos] + (1 - alpha) * h[pos]), h)


def test_a_512_call_sweep_compiles_once_and_equals_its_vmap():
    clean = lh.reap(model, tag="t")(PARAMS, TOKENS).compute()
    calls = [(i, pos, alpha) for i in range(L) for pos in range(T)
             for alpha in np.linspace(0.0, 1.0, 35)][:512]
    assert len(calls) == 512

    def run(i, pos, alpha):
        return lh.plant(model, tag="t")(
            {f"h{j}": lh.intervention(blend_at, clean[f"h{j}"], pos, alpha, i == j)
             for j in range(L)}, PARAMS, CORRUPT)
    counter = CompileCounter()
    got = [run(*c) for c in calls]
    assert counter.count == 1  # the first call's program, reused 511 times
    for c in (calls[0], calls[200], calls[-1]):
        i, pos, alpha = c
        close(got[calls.index(c)], model(PARAMS, CORRUPT, lambda j, h: blend_at(
            h, clean[f"h{j}"], pos, alpha, i == j)))
    layers, positions, alphas = (jnp.array(v) for v in zip(*calls))
    close(jax.vmap(run)(layers, positions, alphas.astype(jnp.float32)), jnp.stack(got),
          rtol=1e-4, atol=1e-5)


def test_plant_calls_with_new_operands_reuse_one_program():
    patch = lambda h, v: h.at[0].set(v)  # noqa: E731  (defined once)
    vs = [jnp.full(D, float(k)) for k in range(4)]
    want = [model(PARAMS, TOKENS, lambda i, h, v=v: patch(h, v) if i == 0 else h) for v in vs]
    plant({"h0": lh.intervention(patch, jnp.ones(D))})
    counter = CompileCounter()
    got = [plant({"h0": lh.intervention(patch, v)}) for v in vs]
    assert counter.count == 0
    close(got, want)


# --- loops, repeated occurrences, cotangents ---------------------------------------

def decode(p, prompt_h, steps, steer=None, positions=()):
    """A KV-cache-style decode loop (`lax.fori_loop`): each step appends a new
    state computed from the cache; `steer` is added at the chosen positions
    (the hand-written intervention)."""
    cache = jnp.zeros((T + steps, D)).at[:T].set(prompt_h)

    def step(t, cache):
        h = jnp.tanh(cache.mean(0) @ p["w"][0] + cache[T + t - 1])
        if steer is None:
            h = lh.sow(h, tag="t", name="dec", mode="clobber")
        else:
            h = h + jnp.where(jnp.isin(T + t, jnp.array(positions)), 1.0, 0.0) * steer
        return cache.at[T + t].set(h)
    return lax.fori_loop(0, steps, step, cache)


def test_a_steering_vector_added_during_a_decode_loop():
    prompt_h = PARAMS["embed"][TOKENS]
    steer = jnp.linspace(-1.0, 1.0, D)
    chosen = jnp.array([6, 8])

    steps = 4
    # the function gets each occurrence's value; the decode position it
    # needs is sown with the value (a pytree site)
    def decode_sown(p, prompt_h):
        cache = jnp.zeros((T + steps, D)).at[:T].set(prompt_h)

        def step(t, cache):
            h = jnp.tanh(cache.mean(0) @ p["w"][0] + cache[T + t - 1])
            h, _ = lh.sow((h, T + t), tag="t", name="dec", mode="clobber")
            return cache.at[T + t].set(h)
        return lax.fori_loop(0, steps, step, cache)

    def steer_at(value, v, chosen):
        h, pos = value
        return h + jnp.isin(pos, chosen).astype(h.dtype) * v, pos
    got = lh.plant(decode_sown, tag="t")(
        {"dec": lh.intervention(steer_at, steer, chosen)}, PARAMS, prompt_h)
    close(got, decode(PARAMS, prompt_h, steps, steer, positions=(6, 8)))
    assert not np.allclose(got, decode(PARAMS, prompt_h, steps, 0 * steer))


def test_every_occurrence_of_an_append_site_in_a_scan():
    def f(x):
        def body(c, _):
            c = lh.sow(jnp.tanh(c) + 1.0, tag="t", name="c", mode="append")
            return c, None
        return lax.scan(body, x, None, length=3)[0]

    def by_hand(x):
        for _ in range(3):
            x = (jnp.tanh(x) + 1.0) * 0.5
        return x
    x = jnp.array([0.5, -1.0, 0.3])
    close(lh.plant(f, tag="t")({"c": lambda c: c * 0.5}, x), by_hand(x))
    # (under jax.jit the function is closed over: it is no array argument)
    close(jax.jit(lambda x: lh.plant(f, tag="t")({"c": lambda c: c * 0.5}, x))(x), by_hand(x))
    d = lh.reap(lh.plant(f, tag="t"), tag="t")({"c": lambda c: c * 0.5}, x)
    assert "c" not in d  # (a planted site is not reaped)


def test_a_function_of_the_cotangent_in_a_backward_function():
    def f(x):
        return jnp.sum(jnp.sin(lh.sow(x * 2.0, tag="t", name="a")) ** 2)
    x = jnp.array([0.5, -1.0, 0.3])
    _, bwd = jax.vjp(f, x)
    # (a backward function built outside the harvest sows the cotangent as "a")
    assert set(lh.reap(bwd, tag="t")(1.0)) == {"a"}
    got = lh.plant(bwd, tag="t")({"a": lambda ct: ct * 10.0}, 1.0)[0]
    # the cotangent reaching `a` is scaled by 10 on its way back to x
    close(got, 10.0 * jax.grad(f)(x))


def test_errors_name_the_site():
    with pytest.raises(lh.HarvestError, match="site 'h1'.*shape"):
        plant({"h1": lambda h: h[:2]})
    with pytest.raises(lh.HarvestError, match="site 'h1'.*dtype"):
        plant({"h1": lambda h: h.astype(jnp.int32)})
    with pytest.raises(lh.HarvestError, match="not callable"):
        lh.intervention(3.0)


@pytest.mark.parametrize("construct", ["while", "cond", "checkpoint", "vmap"])
def test_every_occurrence_in_loops_branches_and_checkpoints(construct):
    half = lambda v: v * 0.5  # noqa: E731

    def f(x, edit=None):
        site = (lambda v: lh.sow(v, tag="t", name="s", mode="clobber")) if edit is None else edit
        if construct == "while":
            return lax.while_loop(lambda c: c[0] < 3,
                                  lambda c: (c[0] + 1, site(jnp.tanh(c[1]) + 1.0)), (0, x))[1]
        if construct == "cond":
            return lax.cond(x[0] > 0, lambda v: site(v * 2.0), lambda v: site(v - 1.0), x)
        if construct == "checkpoint":
            return jnp.sin(jax.checkpoint(lambda v: jnp.cos(site(v * 3.0)))(x))
        return jax.vmap(lambda v: site(jnp.sin(v)))(x)
    x = jnp.array([0.5, -1.0, 0.3])
    close(lh.plant(f, tag="t")({"s": half}, x), f(x, half))
    g = jax.grad(lambda x: jnp.sum(lh.plant(f, tag="t")({"s": half}, x)))
    if construct != "while":  # (no reverse mode through a while loop)
        close(g(x), jax.grad(lambda x: jnp.sum(f(x, half)))(x))
    out, d = lh.harvest(f, tag="t")({"s": half}, x)
    close(out, f(x, half))
    assert "s" not in d
