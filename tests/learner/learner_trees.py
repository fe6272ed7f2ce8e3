"""Tree helpers for the learner tests (a module with a unique name: `conftest` is ambiguous across test folders)."""

import jax
import numpy as np
from flax import nnx


def flat_values(tree) -> dict[str, np.ndarray]:
  """Path -> host array for every leaf of an nnx State (params, gradients)."""
  return {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value() if hasattr(v, "get_value") else v))
          for p, v in nnx.to_flat_state(tree)}
