"""The numeric floor of the library: block-scaled FP8 formats and their pure-JAX reference math."""
