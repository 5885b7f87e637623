"""tilefuse.example_libraries: jax.example_libraries' optimizers and stax, so programs written
against them port by their import."""
