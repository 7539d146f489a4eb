"""A module that initializes JAX's backends when imported (tests/test_check_zygote.py):
a process that imported it must not fork, so `trainrec check` starts fresh interpreters."""

from __future__ import annotations

import jax.numpy as jnp
from check_core_loops import NumpyLoop

ONES = jnp.ones(2)  # JAX runs its threads from here on
LOOP = NumpyLoop()
