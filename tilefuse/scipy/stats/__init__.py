"""tilefuse.scipy.stats: distributions' densities and distribution functions as in
jax.scipy.stats (logpdf, pdf, cdf, ... with loc and scale), composed from tilefuse.numpy and
tilefuse.scipy.special."""

from tilefuse.scipy.stats import (
    bernoulli,
    beta,
    cauchy,
    expon,
    gamma,
    laplace,
    logistic,  # noqa: F401
    multivariate_normal,
    norm,
    poisson,
    t,
    uniform,
)
