"""Subprocess side of tests/eval/test_harness.py's mesh test: on 4 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set by the caller), a tiny Llama
scored by :class:`HarnessLM` on each mesh given (``MESH1 MESH2 ...``, ``-`` for the
default). The last line of stdout is one JSON object: per mesh, the answers and the
bytes of parameters the most loaded device holds."""
import json
import sys

import jax

from tests.eval.mesh_requests import answers, tiny_llama
from transformer_jax import sharding as sh
from transformer_jax.eval_harness import HarnessLM


def main(meshes: list[str]) -> None:
    assert jax.device_count() == 4, jax.devices()
    module, params, tokenizer = tiny_llama()
    out = {}
    for mesh in meshes:
        lm = HarnessLM(module, params, tokenizer, batch_size=4, mesh=None if mesh == "-" else mesh)
        out[mesh] = {"answers": answers(lm), "mesh": sh.describe(lm.mesh),
                     "device_bytes": max(sh.bytes_per_device(lm.params).values())}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
