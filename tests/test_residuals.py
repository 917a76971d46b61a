"""A harvest adds no saved residuals, under every jax.checkpoint policy."""

import contextlib
import io

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

import lazyharvest as lh
from helpers import jax_flag, skip_where_jax_checkpoints_scan3_wrongly

POLICIES = {
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_anything_except_these_names":
        jax.checkpoint_policies.save_anything_except_these_names("never"),
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def _model(policy, mode):
    def layer(c, w):
        h = lh.sow(jnp.sin(c @ w), tag="t", name="h", mode=mode)
        return jnp.tanh(h) * 2, None

    def f(ws, x):
        body = jax.checkpoint(lambda x: jax.lax.scan(layer, x, ws)[0], policy=policy)
        return jnp.sum(body(x) ** 2)
    return f


def _residual_avals(fn, *args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    # "f32[8,3] from ..." -> "f32[8,3]": attributions differ across jit boundaries
    return sorted(line.split()[0] for line in buf.getvalue().splitlines() if line.strip())


@pytest.mark.parametrize("mode", ["append", "clobber"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("how", ["call_and_reap", "plant", "harvest"])
def test_harvest_adds_no_saved_residuals(policy, mode, how):
    ws, x = jnp.full((8, 3, 3), 0.3), jnp.ones(3)
    f = _model(POLICIES[policy], mode)
    harvested = {
        "call_and_reap": lambda ws, x: lh.call_and_reap(f, tag="t")(ws, x)[0],
        "plant": lambda ws, x: lh.plant(f, tag="t")({}, ws, x),
        "harvest": lambda ws, x: lh.harvest(f, tag="t")({}, ws, x)[0],
    }[how]
    assert _residual_avals(harvested, ws, x) == _residual_avals(jax.jit(f), ws, x)


@skip_where_jax_checkpoints_scan3_wrongly()  # (the hand-written program's checkpointed scan)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reading_a_leaf_saves_what_the_hand_written_program_saves(policy):
    ws, x = jnp.full((8, 3, 3), 0.3), jnp.ones(3)
    f = _model(POLICIES[policy], "append")

    def harvested(ws, x):
        out, d = lh.call_and_reap(f, tag="t")(ws, x)
        return out + jnp.sum(d["h"] ** 2)

    def hand(ws, x):
        def layer(c, w):
            h = jnp.sin(c @ w)
            return jnp.tanh(h) * 2, h
        body = jax.checkpoint(lambda x: jax.lax.scan(layer, x, ws),
                              policy=POLICIES[policy])
        y, hs = body(x)
        return jnp.sum(y ** 2) + jnp.sum(hs ** 2)
    # (with jax_remat3 on, a checkpoint holding sites is the remat2 it stands
    # for, which saves what the flag-off program saves: docs/semantics.md, 10d)
    flag_off = jax.config.values.get("jax_remat3") and jax_flag("jax_remat3", False)
    with flag_off or contextlib.nullcontext():
        want = _residual_avals(jax.jit(hand), ws, x)
    assert _residual_avals(harvested, ws, x) == want


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_vjp_inside_a_harvest_saves_what_it_saves_outside(policy):
    # jax.vjp run inside the harvest: its residuals are the leaves of the
    # backward function. A policy that saves the site's value saved both the
    # site's input and output (one more residual per site).
    ws, x = jnp.full((8, 3, 3), 0.3), jnp.ones(3)
    f = _model(POLICIES[policy], "append")

    def residuals(ws, x):
        return jax.tree_util.tree_leaves(jax.vjp(f, ws, x)[1])
    inside, _ = lh.call_and_reap(residuals, tag="t")(ws, x)
    outside = residuals(ws, x)
    assert sorted(map(str, map(jax.typeof, inside))) == sorted(
        map(str, map(jax.typeof, outside)))
    # the harvested gradient and a plant under it stay right
    d = lh.reap(jax.grad(f), tag="t")(ws, x)
    hs = lh.reap(f, tag="t")(ws, x)["h"]
    assert jnp.allclose(d["h"], hs)
    planted = lh.plant(jax.grad(f), tag="t")({"h": hs}, ws, x)
    assert jnp.allclose(planted, jax.grad(f)(ws, x), atol=1e-5)
