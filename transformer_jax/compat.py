"""Where the supported versions of JAX and Flax differ, and the one answer the package uses.

CI runs the tests against the newest versions (``.ci/constraints.txt``) and the tests marked
``colab`` against the ones Colab ships (``.ci/colab-constraints.txt``: jax 0.7.2, flax 0.11.2,
orbax-checkpoint 0.12.4). A difference between them is handled here, in one place:

* flax >= 0.12 shards an ``nnx.Variable`` the moment it is created ("eager sharding", on by
  default) unless :func:`eager_sharding_off` is in effect; 0.11 never does.
* an ``nnx.Param`` made by the Linen bridge keeps its logical axis names under the metadata
  key ``out_sharding`` (0.12) or ``sharding_names`` (0.11): :data:`NNX_AXIS_NAME_KEYS`.
"""
from __future__ import annotations

import contextlib

from flax import nnx

#: where an ``nnx.Param`` made by the bridge keeps its logical axis names (0.12, then 0.11)
NNX_AXIS_NAME_KEYS = ("out_sharding", "sharding_names")


def eager_sharding_off():
    """A context in which new NNX variables are not sharded on creation (a no-op on 0.11)."""
    use = getattr(nnx, "use_eager_sharding", None)
    return use(False) if use is not None else contextlib.nullcontext()
