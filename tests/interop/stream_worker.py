"""Subprocess side of tests/interop/test_hf_streaming.py.

  python tests/interop/stream_worker.py mesh DIR     -> JSON: on 4 simulated CPU devices
      (mesh fsdp=4), the streamed params' shardings against the training loop's and their
      values against an unsharded load
  python tests/interop/stream_worker.py memory DIR   -> JSON: peak RSS growth of a streamed
      bf16 load over the baseline after the imports

The last line of stdout is one JSON object; the test asserts on it.
"""
from __future__ import annotations

import json
import os
import resource
import sys

if sys.argv[1] == "mesh" and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax import sharding as sh  # noqa: E402
from transformer_jax.interop.hf import from_hf  # noqa: E402
from transformer_jax.layers.quant import param_bytes  # noqa: E402


def _paths(tree):
    return {"/".join(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mesh(directory: str) -> dict:
    m = sh.make_mesh("fsdp=4")
    module, params = from_hf(directory, param_dtype="bfloat16", scan_layers=True, mesh=m)
    _, plain = from_hf(directory, param_dtype="bfloat16", scan_layers=True)
    boxed = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    rules = _paths(sh.param_shardings(boxed["params"], m))
    got, ref = _paths(params), _paths(plain)
    return {"devices": jax.device_count(),
            "same_shardings": sorted(k for k in got if got[k].sharding == rules[k]),
            "paths": sorted(got),
            "specs": {k: str(got[k].sharding.spec) for k in got},
            "shard_rows": {k: [s.data.shape for s in got[k].addressable_shards] for k in got},
            "equal": sorted(k for k in got if np.array_equal(
                np.asarray(got[k]).view(np.uint16), np.asarray(ref[k]).view(np.uint16)))}


def memory(directory: str) -> dict:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _, params = from_hf(directory, param_dtype="bfloat16")
    jax.block_until_ready(params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"growth": peak - base, "params_bytes": param_bytes(nn.meta.unbox(params))["total"]}


if __name__ == "__main__":
    print(json.dumps({"mesh": mesh, "memory": memory}[sys.argv[1]](sys.argv[2])), flush=True)
