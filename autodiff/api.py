"""Placeholder until the autodiff issue lands."""


def _missing(*a, **k):
    raise NotImplementedError("autodiff is not implemented yet")


check_grads = custom_vjp = grad = hessian = jacfwd = jacrev = jvp = value_and_grad = vjp = _missing


def stop_gradient(x):
    from tilefuse.numpy import stop_gradient as sg
    return sg(x)
