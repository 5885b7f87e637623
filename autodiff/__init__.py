"""Reverse and forward mode automatic differentiation as transformations over traces."""
from .api import (custom_jvp, custom_vjp, grad, hessian, jacfwd, jacrev, jvp, stop_gradient, value_and_grad,
                  vjp)
from .check import check_grads
from . import control_flow  # noqa: F401  (the rules of cond, while and scan)

__all__ = ["check_grads", "custom_jvp", "custom_vjp", "grad", "hessian", "jacfwd", "jacrev", "jvp",
           "stop_gradient", "value_and_grad", "vjp"]
