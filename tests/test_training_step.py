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
