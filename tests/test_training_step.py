"""call_and_reap in a training step: one forward pass, leaves equal to the
hand-written perturbation trick."""

import jax
import jax.numpy as jnp
import pytest

import lazyharvest as lh
from helpers import close

P = [jnp.eye(8) * 0.5 + 0.01 * i for i in range(3)]
X = jnp.linspace(-1., 1., 32).reshape(4, 8)


def loss(p, x):
    h = x
    for i in range(3):
        h = lh.sow(jnp.tanh(h @ p[i]), tag="t", name=f"h{i}")
    return jnp.sum(h ** 2)


def perturbed(p, x, eps):
    h, acts = x, []
    for i in range(3):
        h = jnp.tanh(h @ p[i]) + eps[i]
        acts.append(h)
    return jnp.sum(h ** 2), acts


def step(p, x):
    (value, grads), d = lh.call_and_reap(jax.value_and_grad(loss), tag="t")(p, x)
    return value, grads, d.compute()


def test_training_step_leaves_equal_the_perturbation_trick():
    value, grads, leaves = jax.jit(step)(P, X)
    eps = [jnp.zeros((4, 8))] * 3
    (want_v, acts), (want_g, want_ct) = jax.value_and_grad(
        perturbed, argnums=(0, 2), has_aux=True)(P, X, eps)
    close(value, want_v)
    close(grads, want_g)
    for i in range(3):
        close(leaves[f"h{i}"], acts[i])
        close(leaves["vjp"][f"h{i}"], want_ct[i])


@pytest.mark.parametrize("read", ["all", "one", "none"])
def test_training_step_runs_the_forward_pass_once(read):
    def traced_step(p, x):
        (value, grads), d = lh.call_and_reap(jax.value_and_grad(loss), tag="t")(p, x)
        extra = {"all": lambda: d.compute(), "one": lambda: d["vjp", "h1"],
                 "none": lambda: None}[read]()
        return value, grads, extra
    jaxpr = str(jax.make_jaxpr(traced_step)(P, X))
    hand = str(jax.make_jaxpr(lambda p, x: jax.value_and_grad(perturbed, argnums=(0, 2),
                                                              has_aux=True)(
        p, x, [jnp.zeros((4, 8))] * 3))(P, X))
    assert jaxpr.count("tanh") == hand.count("tanh") == 3


def _counted_loss(runs):
    def counted(p, x):
        jax.debug.callback(lambda: runs.append(1))  # once per run of the forward pass
        return loss(p, x)
    return counted


def test_eager_call_and_reap_in_a_loop_runs_its_passes_once_per_step():
    # eagerly, the call returns the leaves the previous step's dict read, so
    # reading them again runs nothing; a leaf it did not read runs its slice
    runs: list = []
    step_fn = lh.call_and_reap(jax.value_and_grad(_counted_loss(runs)), tag="t")
    names = [f"h{i}" for i in range(3)]
    counts = []
    for k in range(4):
        x = X * (1.0 + 0.1 * k)
        before = len(runs)
        (value, grads), d = step_fn(P, x)
        got = d.compute(*[("vjp", n) for n in names])
        counts.append(len(runs) - before)
        eps = [jnp.zeros((4, 8))] * 3
        want_value, want_grads = jax.value_and_grad(loss)(P, x)
        close(value, want_value)
        close(grads, want_grads)
        want_cts = jax.grad(lambda e: perturbed(P, x, e)[0])(eps)
        for i, n in enumerate(names):
            close(got["vjp"][n], want_cts[i])
    assert counts == [2, 1, 1, 1]
    # a read the previous dict did not make runs its slice, and joins the next call
    before = len(runs)
    _, d = step_fn(P, X)
    close(d["h0"], jnp.tanh(X @ P[0]))
    assert len(runs) - before == 2
    before = len(runs)
    _, d = step_fn(P, X)
    close(d["h0"], jnp.tanh(X @ P[0]))
    assert len(runs) - before == 1


def test_eager_call_and_reap_computes_no_leaf_nobody_read():
    runs: list = []
    step_fn = lh.call_and_reap(_counted_loss(runs), tag="t")
    for _ in range(2):
        _, d = step_fn(P, X)  # nothing read
    assert d._store.values == {}
    _, d = step_fn(P, X)
    d["h1"]
    _, d = step_fn(P, X)
    assert [d._store.traced.key_of[k][0] for k in d._store.values] == [("h1",)]
