"""Pytrees the checkers make (random tangents and cotangents, zeros) and inspect."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def float_leaves(tree: Any) -> bool:
    """Whether `tree` has leaves and all of them are floating."""
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(is_float(x) for x in leaves)


def random_like(tree: Any, seed: int, scale: float = 1.0) -> Any:
    """Random values shaped like `tree` (float0 zeros for non-float leaves)."""
    rng = np.random.RandomState(seed)

    def one(x: Any) -> Any:
        shape, dtype = np.shape(x), jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.inexact):
            return np.zeros(shape, jax.dtypes.float0)
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)
    return jax.tree_util.tree_map(one, tree)


def zeros_like_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.zeros(np.shape(x), jnp.result_type(x)), tree)


def all_zero(x: Any) -> bool:
    """Whether every leaf of `x` is zero (float0 leaves count as zero)."""
    for leaf in jax.tree_util.tree_leaves(x):
        a = np.asarray(leaf)
        if a.dtype != jax.dtypes.float0 and np.any(a != 0):
            return False
    return True
