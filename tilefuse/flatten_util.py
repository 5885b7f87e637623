"""tilefuse.flatten_util.ravel_pytree: a pytree of arrays as one flat vector and back
(jax.flatten_util), for optimizers and samplers written over a single vector."""

from __future__ import annotations

import numpy as np

import tilefuse.numpy as tnp
from tilefuse.tracer.pytree import tree_flatten, tree_unflatten

__all__ = ["ravel_pytree"]


def ravel_pytree(pytree):
    """(flat, unravel): the leaves raveled and concatenated in the promoted dtype, and a function
    turning such a vector back into the tree (each leaf in its shape and dtype)."""
    leaves, treedef = tree_flatten(pytree)
    leaves = [tnp.asarray(x) if not isinstance(x, (tnp.Tracer, tnp.Array)) else x for x in leaves]
    shapes = [tnp.shape(x) for x in leaves]
    dtypes = [tnp.result_type(x) for x in leaves]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    dtype = tnp.result_type(*leaves) if leaves else tnp.float32
    flat = (
        tnp.concatenate([tnp.ravel(tnp.astype(x, dtype)) for x in leaves])
        if leaves
        else tnp.zeros((0,), dtype)
    )

    def unravel(vec):
        if tnp.shape(vec) != (sum(sizes),):
            raise ValueError(f"unravel: expected a vector of shape {(sum(sizes),)}, got {tnp.shape(vec)}")
        parts, start = [], 0
        for s, n, d in zip(shapes, sizes, dtypes):
            parts.append(tnp.astype(tnp.reshape(vec[start : start + n], s), d))
            start += n
        return tree_unflatten(treedef, parts)

    return flat, unravel
