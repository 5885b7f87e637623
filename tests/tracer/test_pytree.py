"""Pytrees: flatten/unflatten round trips for every container kind, tree definitions as keys."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pytest

import tilefuse as tx
from tilefuse.tracer import pytree


class Point(NamedTuple):
    x: object
    y: object


@tx.register_dataclass
@dataclass
class Params:
    w: object
    b: object


@tx.register_dataclass(meta_fields=("name",))
@dataclass(frozen=True)
class Layer:
    kernel: object
    name: str = "dense"


@pytree.register_dataclass
class Plain:  # not yet a dataclass: the decorator makes it one
    a: object
    b: object = None


@dataclass
class WithDerived:
    a: object
    n: int = field(init=False, default=0)


pytree.register_dataclass(WithDerived)


class Box:
    """A custom node: children are the contents, the label is static aux data."""

    def __init__(self, label, items):
        self.label, self.items = label, items

    def __eq__(self, other):
        return isinstance(other, Box) and (self.label, self.items) == (other.label, other.items)


tx.register_pytree_node(Box, lambda b: (b.items, b.label), lambda label, items: Box(label, list(items)))

TREES = [
    1.0,
    None,
    (),
    [],
    {},
    (1, 2.0),
    (1,),
    [1, [2, (3, None)]],
    {"b": 1, "a": 2, "c": [3, 4]},
    {"z": None, "y": {"k": (5,)}},
    Point(1, Point(2, 3)),
    Params(w=1, b=[2, 3]),
    Layer(kernel=(1, 2), name="head"),
    Plain(a=1, b=(2,)),
    Box("lbl", [1, {"q": 2}]),
    collections.OrderedDict([("z", 1), ("a", 2)]),
    collections.defaultdict(list, {"b": 1, "a": 2}),
    [Point(None, 1), {"p": Params(1, 2)}, (Box("x", []),)],
]


def _same(a, b):
    if isinstance(a, collections.OrderedDict):
        return isinstance(b, collections.OrderedDict) and list(a.items()) == list(b.items())
    if isinstance(a, collections.defaultdict):
        return isinstance(b, collections.defaultdict) and a == b and a.default_factory is b.default_factory
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("tree", TREES, ids=[f"{i}-{type(t).__name__}" for i, t in enumerate(TREES)])
def test_round_trip(tree):
    leaves, td = tx.tree_flatten(tree)
    assert td.n_leaves == len(leaves)
    back = tx.tree_unflatten(td, leaves)
    assert _same(back, tree), (back, tree)
    assert tx.tree_structure(tree) == td and hash(tx.tree_structure(tree)) == hash(td)
    doubled = tx.tree_map(lambda v: v * 2, tree)
    assert tx.tree_leaves(doubled) == [v * 2 for v in leaves]
    assert tx.tree_structure(doubled) == td


def test_leaf_order_and_dict_keys_sorted():
    assert tx.tree_leaves({"b": 1, "a": 2, "c": 3}) == [2, 1, 3]
    assert tx.tree_leaves(collections.OrderedDict([("b", 1), ("a", 2)])) == [1, 2]
    assert tx.tree_leaves([1, None, (2, {"y": 3, "x": 4})]) == [1, 2, 4, 3]
    assert tx.tree_leaves(Params(w=1, b=2)) == [1, 2]
    assert tx.tree_leaves(Layer(kernel=5, name="n")) == [5]  # name is static aux data
    assert tx.tree_structure({"a": 1, "b": 2}) == tx.tree_structure({"b": 0, "a": 9})


def test_structures_differ_where_they_should():
    assert tx.tree_structure((1, 2)) != tx.tree_structure([1, 2])
    assert tx.tree_structure((1, 2)) != tx.tree_structure((1, (2,)))
    assert tx.tree_structure({"a": 1}) != tx.tree_structure({"b": 1})
    assert tx.tree_structure(Layer(1, "a")) != tx.tree_structure(Layer(1, "b"))
    assert tx.tree_structure(None) != tx.tree_structure(())
    assert tx.tree_structure(Point(1, 2)) != tx.tree_structure((1, 2))


def test_arrays_are_leaves():
    x = np.ones(3)
    a = tx.device_put(np.zeros(2))
    leaves, td = tx.tree_flatten({"x": x, "a": [a]})
    assert leaves[0] is a and leaves[1] is x and td.n_leaves == 2


def test_treedef_repr():
    assert repr(tx.tree_structure((1, [2, None], {"a": 3}))) == "PyTreeDef((*, [*, None], {'a': *}))"
    assert repr(tx.tree_structure((1,))) == "PyTreeDef((*,))"
    assert "Layer(*, aux=('x',))" in repr(tx.tree_structure(Layer(1, "x")))


def test_tree_map_several_trees_and_is_leaf():
    out = tx.tree_map(lambda a, b: a + b, {"x": 1, "y": (2,)}, {"x": 10, "y": (20,)})
    assert out == {"x": 11, "y": (22,)}
    with pytest.raises(tx.TilefuseError, match="structures differ"):
        tx.tree_map(lambda a, b: a, (1, 2), [1, 2])
    pairs = tx.tree_map(lambda p: p[0], [(1, 2), (3, 4)], is_leaf=lambda t: isinstance(t, tuple))
    assert pairs == [1, 3]
    assert tx.tree_leaves([None, 1], is_leaf=lambda v: v is None) == [None, 1]


def test_unflatten_checks_the_leaf_count():
    _, td = tx.tree_flatten((1, 2))
    with pytest.raises(tx.TilefuseError, match="2 leaves, got 3"):
        tx.tree_unflatten(td, [1, 2, 3])
    assert td.unflatten([5, 6]) == (5, 6)


def test_dataclass_fields_outside_init_survive():
    w = WithDerived(a=1)
    w.n = 7
    back = tx.tree_unflatten(*reversed(tx.tree_flatten(w)))
    assert back.a == 1 and back.n == 7


def test_unsortable_dict_keys_are_an_error():
    with pytest.raises(tx.TilefuseError, match="sortable"):
        tx.tree_flatten({1: "a", "b": 2})


def test_bad_dataclass_registration():
    @dataclass
    class D:
        a: int

    with pytest.raises(tx.TilefuseError, match="no fields named"):
        tx.register_dataclass(D, meta_fields=("nope",))


def test_leaf_paths():
    _, td = tx.tree_flatten({"w": [1, 2], "b": (3,)})
    assert pytree.leaf_paths(td) == ["['b'][0]", "['w'][0]", "['w'][1]"]
    assert pytree.is_node((1,)) and pytree.is_node(Params(1, 2)) and not pytree.is_node(np.ones(2))


def test_pytrees_through_jit(device):
    f = tx.jit(lambda p, pt, layer: (Params(w=p.w * 2, b=p.b), Point(pt.y, pt.x), layer))
    p = Params(np.ones(2, np.float32), np.zeros(1, np.float32))
    out_p, out_pt, out_layer = f(p, Point(np.float32(1), np.float32(2)), Layer(np.ones(1, np.float32), "x"))
    assert isinstance(out_p, Params) and isinstance(out_pt, Point) and isinstance(out_layer, Layer)
    np.testing.assert_array_equal(out_p.w, [2, 2])
    assert float(out_pt.x) == 2.0 and out_layer.name == "x"
    f(p, Point(np.float32(3), np.float32(4)), Layer(np.zeros(1, np.float32), "x"))
    assert f.trace_count == 1
    f(p, Point(np.float32(3), np.float32(4)), Layer(np.zeros(1, np.float32), "y"))  # new aux: retrace
    assert f.trace_count == 2
