"""Every primitive of the table against an independent numpy reference, on every device.

The table (op records × shapes × dtypes, with 0-d, size 1 and size 0 shapes) lives in the package,
tilefuse/validate/primitives.py, so that `python -m tilefuse.validate` runs the very same cases:
add a new primitive's row there. Each record runs eagerly (one primitive on device Arrays) and
under jit, and checks the shape rule against what came out. A primitive without a row fails
`test_every_primitive_has_a_record`."""
from __future__ import annotations

import numpy as np
import pytest

import tilefuse as tx
from tilefuse import validate
from tilefuse.ir import primitives as P
from tilefuse.ir.core import ShapedArray
from tilefuse.validate.primitives import NO_VALUE_RECORD, OPS


def _cases():
    for case in validate.cases(groups=("primitive",)):
        yield pytest.param(case, id=case.id)


def test_every_primitive_has_a_record():
    covered = {op.prim.name for op in OPS} | NO_VALUE_RECORD
    missing = sorted(set(P.PRIMITIVES) - covered)
    assert not missing, f"primitives without a row in the table (tilefuse/validate/primitives.py): {missing}"


@pytest.mark.parametrize("case", list(_cases()))
def test_primitive(case, device):
    if not device.supports(case.dtype):
        pytest.skip(f"{device} has no {np.dtype(case.dtype).name}")
    validate.check(case, device)


def test_rules_reject_bad_operands():
    f32 = ShapedArray((2, 3), np.dtype(np.float32))
    with pytest.raises(tx.ShapeError, match=r"\(2, 3\), \(3, 2\)"):
        P.add.abstract_eval(f32, ShapedArray((3, 2), np.dtype(np.float32)))
    with pytest.raises(tx.DTypeError, match="int32"):
        P.add.abstract_eval(f32, ShapedArray((2, 3), np.dtype(np.int32)))
    with pytest.raises(tx.DTypeError):
        P.exp.abstract_eval(ShapedArray((2,), np.dtype(np.int32)))
    with pytest.raises(tx.ShapeError, match="contracting"):
        P.dot_general.abstract_eval(f32, f32, dimension_numbers=(((1,), (0,)), ((), ())))
    with pytest.raises(tx.ShapeError):
        P.reshape.abstract_eval(f32, new_sizes=(5,))
    with pytest.raises(tx.ShapeError):
        P.reduce_max.abstract_eval(ShapedArray((0, 3), np.dtype(np.float32)), axes=(0,))
    with pytest.raises(tx.ShapeError):
        P.slice_.abstract_eval(f32, start_indices=(0, 0), limit_indices=(3, 3), strides=(1, 1))
    with pytest.raises(tx.ShapeError):
        P.broadcast_in_dim.abstract_eval(f32, shape=(2, 4), broadcast_dimensions=(0, 1))
    with pytest.raises(tx.DTypeError):
        P.select.abstract_eval(f32, f32, f32)
    with pytest.raises(tx.DTypeError):
        P.gather.abstract_eval(f32, f32, axis=0)


def test_weak_type_propagates_through_elementwise_rules():
    w = ShapedArray((), np.dtype(np.float32), True)
    s = ShapedArray((), np.dtype(np.float32), False)
    assert P.add.abstract_eval(w, w)[0].weak_type
    assert not P.add.abstract_eval(w, s)[0].weak_type
    assert not P.lt.abstract_eval(w, w)[0].weak_type  # bool results are never weak
    assert P.exp.abstract_eval(w)[0].weak_type


def test_primitive_flags():
    assert P.debug_print.effectful and P.debug_print.multiple_results
    assert P.add.elementwise and P.exp.elementwise and not P.dot_general.elementwise
    assert not P.add.effectful
    assert P.PRIMITIVES["add"] is P.add
