"""Pytrees: nested containers of arrays flattened to leaves and a hashable tree definition."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

from tilefuse.ir.errors import TilefuseError


class NodeType(NamedTuple):
    to_iterable: Callable  # node -> (children, aux data)
    from_iterable: Callable  # (aux data, children) -> node


_registry: dict[type, NodeType] = {}


def register_pytree_node(cls: type, flatten: Callable, unflatten: Callable) -> None:
    """Register a container type: flatten(node) -> (children, aux); unflatten(aux, children).
    aux must be hashable: it is part of jit's cache key."""
    _registry[cls] = NodeType(flatten, unflatten)


def _dict_flatten(d):
    try:
        keys = sorted(d)
    except TypeError as e:
        raise TilefuseError(f"pytree dict keys must be sortable, got {list(d)}") from e
    return [d[k] for k in keys], tuple(keys)


register_pytree_node(tuple, lambda t: (t, None), lambda _, c: tuple(c))
register_pytree_node(list, lambda l: (l, None), lambda _, c: list(c))
register_pytree_node(type(None), lambda n: ((), None), lambda _, c: None)
register_pytree_node(dict, _dict_flatten, lambda keys, c: dict(zip(keys, c)))
# an OrderedDict keeps its order (it is part of its meaning); a defaultdict keeps its factory
register_pytree_node(collections.OrderedDict, lambda d: (list(d.values()), tuple(d)),
                     lambda keys, c: collections.OrderedDict(zip(keys, c)))
register_pytree_node(collections.defaultdict,
                     lambda d: (_dict_flatten(d)[0], (d.default_factory, _dict_flatten(d)[1])),
                     lambda aux, c: collections.defaultdict(aux[0], zip(aux[1], c)))


def register_dataclass(cls=None, *, data_fields=None, meta_fields=()):
    """Class decorator: make a dataclass a pytree node. Fields are children (traced arrays)
    except `meta_fields`, which are static data kept in the tree definition (hashable)."""
    if cls is None:
        return lambda c: register_dataclass(c, data_fields=data_fields, meta_fields=meta_fields)
    if not dataclasses.is_dataclass(cls):
        cls = dataclasses.dataclass(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    meta = tuple(meta_fields)
    data = tuple(data_fields) if data_fields is not None else tuple(n for n in names if n not in meta)
    unknown = set(data + meta) - set(names)
    if unknown:
        raise TilefuseError(f"register_dataclass({cls.__name__}): no fields named {sorted(unknown)}")

    init = {f.name for f in dataclasses.fields(cls) if f.init}

    def unflatten(aux, children):
        values = dict(zip(data, children))
        values.update(zip(meta, aux))
        obj = cls(**{k: v for k, v in values.items() if k in init})
        for k, v in values.items():  # fields outside __init__ (init=False)
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj

    register_pytree_node(cls, lambda x: ([getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta)),
                         unflatten)
    return cls


def _node_type(x):
    t = type(x)
    nt = _registry.get(t)
    if nt is not None:
        return nt
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        nt = NodeType(lambda n: (tuple(n), None), lambda _, c, t=t: t(*c))
        _registry[t] = nt
        return nt
    return None


def is_node(x) -> bool:
    """Whether x is a container pytrees look into (a registered type, a namedtuple)."""
    return _node_type(x) is not None


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
        return self is other or isinstance(other, PyTreeDef) and self._hash == other._hash and (
            self.node_type, self.aux, self.children) == (other.node_type, other.aux, other.children)

    def __repr__(self):
        return f"PyTreeDef({self._str()})"

    def _str(self) -> str:
        t = self.node_type
        kids = [c._str() for c in self.children]
        if t is None:
            return "*"
        if t is type(None):
            return "None"
        if t is tuple:
            return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
        if t is list:
            return "[" + ", ".join(kids) + "]"
        if t is dict:
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.aux, kids)) + "}"
        aux = "" if self.aux in (None, ()) else f", aux={self.aux!r}"
        return f"{t.__name__}({', '.join(kids)}{aux})"

    def unflatten(self, leaves):
        return tree_unflatten(self, leaves)


LEAF = PyTreeDef(None, None, ())


MAX_DEPTH = 200  # nested containers: deeper is a container that holds itself, or a mistake


def tree_flatten(x, is_leaf: Callable | None = None) -> tuple[list, PyTreeDef]:
    """Leaves in a fixed order (dicts by sorted key) and the tree's definition."""
    leaves: list = []
    return leaves, _flatten(x, 0, leaves, is_leaf)


def _flatten(x, depth: int, leaves: list, is_leaf) -> PyTreeDef:
    # (a module function for the reason _build is one: no cycle holding the leaves)
    nt = None if is_leaf is not None and is_leaf(x) else _node_type(x)
    if nt is None:
        leaves.append(x)
        return LEAF
    if depth == MAX_DEPTH:  # (before Python's recursion limit, wherever the caller is)
        raise TilefuseError(f"a pytree nests containers more than {MAX_DEPTH} deep (here a "
                            f"{type(x).__name__}): does a list or dict contain itself?")
    children, aux = nt.to_iterable(x)
    return PyTreeDef(type(x), aux, tuple(_flatten(c, depth + 1, leaves, is_leaf) for c in children))


def tree_unflatten(treedef: PyTreeDef, leaves) -> Any:
    leaves = list(leaves)
    if len(leaves) != treedef.n_leaves:
        raise TilefuseError(f"tree_unflatten: {treedef} has {treedef.n_leaves} leaves, got {len(leaves)}")
    return _build(treedef, iter(leaves))


def _build(td: PyTreeDef, it):
    # (a module function, not a closure calling itself: that would be a reference cycle holding
    # the leaves, a jitted call's outputs, until the garbage collector runs)
    if td.node_type is None:
        return next(it)
    return _registry[td.node_type].from_iterable(td.aux, [_build(c, it) for c in td.children])


def tree_leaves(x, is_leaf: Callable | None = None) -> list:
    return tree_flatten(x, is_leaf)[0]


def tree_structure(x, is_leaf: Callable | None = None) -> PyTreeDef:
    return tree_flatten(x, is_leaf)[1]


def tree_map(f: Callable, tree, *rest, is_leaf=None):
    """f applied to the leaves of `tree` (and the matching leaves of `rest`, same structure)."""
    leaves, td = tree_flatten(tree, is_leaf)
    others = []
    for r in rest:
        rl, rtd = tree_flatten(r, is_leaf)
        if rtd != td:
            raise TilefuseError(f"tree_map: pytree structures differ: {td} vs {rtd}")
        others.append(rl)
    return tree_unflatten(td, [f(*xs) for xs in zip(leaves, *others)])


def leaf_paths(td: PyTreeDef) -> list[str]:
    """Index paths ("[0]['w']") of the leaves of a tree definition, in flattening order."""
    if td.node_type is None:
        return [""]
    if td.node_type in (dict, collections.OrderedDict):
        keys = td.aux
    elif td.node_type is collections.defaultdict:
        keys = td.aux[1]
    else:
        keys = range(len(td.children))
    return [f"[{k!r}]{p}" for k, c in zip(keys, td.children) for p in leaf_paths(c)]
