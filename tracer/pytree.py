"""Pytrees: nested containers of arrays flattened to leaves and a hashable tree definition."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from tilefuse.ir.errors import TilefuseError


class NodeType(NamedTuple):
    to_iterable: Callable  # node -> (children, aux data)
    from_iterable: Callable  # (aux data, children) -> node


_registry: dict[type, NodeType] = {}


def register_pytree_node(cls: type, flatten: Callable, unflatten: Callable) -> None:
    """Register a container type: flatten(node) -> (children, aux); unflatten(aux, children)."""
    _registry[cls] = NodeType(flatten, unflatten)


register_pytree_node(tuple, lambda t: (t, None), lambda _, c: tuple(c))
register_pytree_node(list, lambda l: (l, None), lambda _, c: list(c))
register_pytree_node(type(None), lambda n: ((), None), lambda _, c: None)


def _dict_flatten(d):
    try:
        keys = sorted(d)
    except TypeError as e:
        raise TilefuseError(f"pytree dict keys must be sortable, got {list(d)}") from e
    return [d[k] for k in keys], tuple(keys)


register_pytree_node(dict, _dict_flatten, lambda keys, c: dict(zip(keys, c)))


def register_dataclass(cls):
    """Class decorator: make a dataclass a pytree node (all fields are children)."""
    if not dataclasses.is_dataclass(cls):
        cls = dataclasses.dataclass(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    register_pytree_node(cls, lambda x: ([getattr(x, n) for n in names], None),
                         lambda _, c: cls(**dict(zip(names, c))))
    return cls


def _node_type(x):
    t = type(x)
    if t in _registry:
        return _registry[t]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        nt = NodeType(lambda n: (tuple(n), None), lambda _, c, t=t: t(*c))
        _registry[t] = nt
        return nt
    return None


class PyTreeDef:
    """The structure of a pytree: node type, aux data and children's defs (hashable)."""
    __slots__ = ("node_type", "aux", "children", "n_leaves", "_hash")

    def __init__(self, node_type, aux, children):
        self.node_type, self.aux, self.children = node_type, aux, children
        self.n_leaves = 1 if node_type is None else sum(c.n_leaves for c in children)
        self._hash = hash((node_type, aux, children))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, PyTreeDef) and self._hash == other._hash and (
            self.node_type, self.aux, self.children) == (other.node_type, other.aux, other.children)

    def __repr__(self):
        if self.node_type is None:
            return "*"
        return f"{self.node_type}({', '.join(map(repr, self.children))}{'' if self.aux is None else ', ' + repr(self.aux)})"

    def unflatten(self, leaves):
        return tree_unflatten(self, leaves)


LEAF = PyTreeDef(None, None, ())


def tree_flatten(x, is_leaf: Callable | None = None) -> tuple[list, PyTreeDef]:
    leaves: list = []

    def rec(x):
        nt = None if is_leaf is not None and is_leaf(x) else _node_type(x)
        if nt is None:
            leaves.append(x)
            return LEAF
        children, aux = nt.to_iterable(x)
        return PyTreeDef(type(x), aux, tuple(rec(c) for c in children))

    return leaves, rec(x)


def tree_unflatten(treedef: PyTreeDef, leaves) -> Any:
    it = iter(leaves)

    def rec(td):
        if td.node_type is None:
            return next(it)
        return _registry[td.node_type].from_iterable(td.aux, [rec(c) for c in td.children])

    out = rec(treedef)
    return out


def tree_leaves(x) -> list:
    return tree_flatten(x)[0]


def tree_structure(x) -> PyTreeDef:
    return tree_flatten(x)[1]


def tree_map(f: Callable, tree, *rest, is_leaf=None):
    leaves, td = tree_flatten(tree, is_leaf)
    others = []
    for r in rest:
        rl, rtd = tree_flatten(r, is_leaf)
        if rtd != td:
            raise TilefuseError(f"tree_map: pytree structures differ: {td} vs {rtd}")
        others.append(rl)
    return tree_unflatten(td, [f(*xs) for xs in zip(leaves, *others)])
