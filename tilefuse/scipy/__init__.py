"""tilefuse.scipy: the parts of scipy that JAX mirrors in jax.scipy (special, stats, linalg),
over tilefuse's primitives, on every device."""

from tilefuse.scipy import linalg, special, stats  # noqa: F401
