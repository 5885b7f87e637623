"""tilefuse.tree_util: the pytree functions under JAX's module name (jax.tree_util), so code
written against it ports by its import. The implementation is tilefuse.tracer.pytree."""

from __future__ import annotations

import functools
from typing import Any, Callable

from tilefuse.tracer.pytree import (
    PyTreeDef,
    register_dataclass,
    register_pytree_node,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_structure,
    tree_unflatten,
)

__all__ = [
    "PyTreeDef",
    "Partial",
    "register_dataclass",
    "register_pytree_node",
    "register_pytree_node_class",
    "tree_all",
    "tree_any",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_reduce",
    "tree_structure",
    "tree_transpose",
    "tree_unflatten",
    "treedef_children",
    "treedef_is_leaf",
    "all_leaves",
]

_NO_INITIAL = object()


def tree_reduce(function: Callable, tree, initializer: Any = _NO_INITIAL, is_leaf=None):
    leaves = tree_leaves(tree, is_leaf)
    return (
        functools.reduce(function, leaves)
        if initializer is _NO_INITIAL
        else functools.reduce(function, leaves, initializer)
    )


def tree_all(tree, *, is_leaf=None) -> bool:
    return all(bool(x) for x in tree_leaves(tree, is_leaf))


def tree_any(tree, *, is_leaf=None) -> bool:
    return any(bool(x) for x in tree_leaves(tree, is_leaf))


def treedef_is_leaf(treedef: PyTreeDef) -> bool:
    return treedef.node_type is None


def treedef_children(treedef: PyTreeDef) -> list:
    return list(treedef.children)


def all_leaves(iterable, is_leaf=None) -> bool:
    return all(tree_structure(x, is_leaf).node_type is None for x in iterable)


def tree_transpose(outer_treedef: PyTreeDef, inner_treedef: PyTreeDef, pytree_to_transpose):
    """An outer tree of inner trees -> an inner tree of outer trees."""
    flat = tree_leaves(pytree_to_transpose)
    n_inner = inner_treedef.n_leaves
    groups = [flat[i : i + n_inner] for i in range(0, len(flat), n_inner)]
    columns = [tree_unflatten(outer_treedef, [g[k] for g in groups]) for k in range(n_inner)]
    return tree_unflatten(inner_treedef, columns)


def register_pytree_node_class(cls):
    """Class decorator: cls.tree_flatten() -> (children, aux) and cls.tree_unflatten(aux, children)."""
    register_pytree_node(cls, lambda x: x.tree_flatten(), cls.tree_unflatten)
    return cls


class Partial(functools.partial):
    """functools.partial that is a pytree: its bound arguments are leaves and the function is
    static, so it can pass through jit and be returned from transformations."""

    def __new__(cls, func, *args, **kwargs):
        return super().__new__(cls, func, *args, **kwargs)


register_pytree_node(
    Partial,
    lambda p: ((p.args, p.keywords), p.func),
    lambda func, children: Partial(func, *children[0], **children[1]),
)
