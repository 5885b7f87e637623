"""The bottom layer: dtypes, avals, the graph IR, the primitive table, passes and kernel IR."""
from . import dtypes, errors, primitives
from .core import Eqn, Graph, Literal, ShapedArray, Var, eval_graph, typecheck_graph
from .errors import (CompileError, ConcretizationError, DeviceError, DTypeError, OutOfMemoryError,
                     ShapeError, TilefuseError, TracerLeakError, TransformError)
from .primitives import PRIMITIVES, Primitive
