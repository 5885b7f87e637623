"""Graph passes: each a named pure function Graph -> Graph; `manager.PIPELINE` lists them in
order. `fusion.partition` groups the optimised graph into regions, each lowered to kernels."""
from .cse import cse
from .dce import dce
from .fold import fold_constants
from .fusion import Region, partition
from .manager import BEFORE_AD, PIPELINE, Dump, prepare_for_ad, run_passes
from .simplify import RULES, fold_transpose_into_dot, simplify

__all__ = ["BEFORE_AD", "PIPELINE", "RULES", "Dump", "Region", "cse", "dce", "fold_constants", "prepare_for_ad",
           "fold_transpose_into_dot", "partition", "run_passes", "simplify"]
