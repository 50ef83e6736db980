"""The model families for tests/test_nnx.py, and its subprocess side on 4 simulated CPU devices.

  python tests/nnx_worker.py   -> JSON: per family, the parameters whose NNX sharding
                                  differs from the Linen training path's, and samples;
                                  GPT's logits and one optimizer step on the mesh

Run as a script it sets ``--xla_force_host_platform_device_count=4`` itself when the caller
has not (the device count must be fixed before JAX starts); imported, it changes nothing.
The last line of stdout is one JSON object; the test asserts on it.
"""
from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=4").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from transformer_jax.models import (CLIP, CLIPConfig, GPT, GPTConfig, T5, T5Config, Bert,  # noqa: E402
                                    BertConfig, Transformer, TransformerConfig, ViT, ViTConfig)

B, T = 4, 8


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cases() -> dict:
    """name -> (module, inputs, loss(output), Adam learning rate): tiny presets with one
    layer, a fixed batch and a real loss (next token, masked-token reconstruction, classes,
    CLIP's matching pairs). CLIP's contrastive loss over 4 pairs is sharp: Adam's first step
    (every weight moved by about the learning rate) overshoots it above ~3e-4."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (B, T + 1)).astype(np.int32)
    src = rng.integers(2, 512, (B, T)).astype(np.int32)
    images = rng.standard_normal((B, 16, 16, 3)).astype(np.float32)
    classes = np.array([1, 7, 3, 0], np.int32)
    caption = rng.integers(3, 100, (B, T)).astype(np.int32)
    caption[:, -1] = 1                                    # CLIP pools at its end-of-text id
    pairs = np.arange(B)
    next_token = lambda logits: ce(logits, ids[:, 1:])    # noqa: E731
    return {
        "gpt": (GPT(GPTConfig.preset("tiny", num_layers=1)), (ids[:, :-1],), next_token, 1e-2),
        "llama": (GPT(GPTConfig.preset("llama-tiny", num_layers=1)), (ids[:, :-1],), next_token, 1e-2),
        "bert": (Bert(BertConfig.preset("tiny", num_layers=1)), (ids[:, :-1],),
                 lambda out: ce(out["mlm_logits"], ids[:, :-1]), 1e-2),
        "t5": (T5(T5Config.preset("tiny", num_layers=1)), (src, ids[:, :-1]), next_token, 1e-2),
        "vit": (ViT(ViTConfig.preset("tiny", num_layers=1)), (images,), lambda out: ce(out, classes), 1e-2),
        "clip": (CLIP(CLIPConfig.preset("tiny", vocab_size=100, vision_layers=1, text_layers=1)),
                 (caption, images),
                 lambda out: ce(out["logits_per_image"], pairs) + ce(out["logits_per_text"], pairs), 3e-4),
        "transformer": (Transformer(TransformerConfig.preset("tiny", num_layers=1)),
                        (src, ids[:, :-1]), next_token, 1e-2),
    }


def specs(tree) -> dict[str, str]:
    """'path/to/leaf' -> str(PartitionSpec) of each array (or NamedSharding) in ``tree``."""
    from transformer_jax.nnx import _keys
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(x, "sharding", x)
        out["/".join(_keys(path))] = spec_text(sharding.spec)
    return out


def spec_text(spec) -> str:
    """``P('fsdp', None)``: a PartitionSpec as jax >= 0.8 prints it (0.7 writes ``PartitionSpec(...)``)."""
    return str(spec).replace("PartitionSpec(", "P(", 1)


def main() -> dict:
    from flax import nnx

    from transformer_jax import sharding as sh
    from transformer_jax.nnx import linen_params, to_nnx

    mesh = sh.make_mesh("fsdp=2,tensor=2")
    out = {"devices": len(jax.devices()), "families": {}}
    for name, (module, inputs, _, _) in cases().items():
        model = to_nnx(module, *inputs, rngs=nnx.Rngs(0), mesh=mesh)
        got = specs(linen_params(model))
        boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs))["params"]
        want = specs(sh.param_shardings(boxed, mesh))
        out["families"][name] = {
            "params": len(want),
            "sharded": sum(s != "P()" for s in want.values()),
            "differ": {k: [got.get(k), v] for k, v in want.items() if got.get(k) != v},
        }
    # GPT with an odd vocabulary (511: replicated over tensor=2), sharded and on one device
    module, (ids,), loss_of, lr = cases()["gpt"]
    module = GPT(module.config.replace(vocab_size=511))
    ids = ids % 511
    model = to_nnx(module, ids, rngs=nnx.Rngs(0), mesh=mesh)
    single = to_nnx(module, ids, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(ids)))(model)
        optimizer.update(model, grads)
        return loss

    call = nnx.jit(lambda m: m(ids))
    with sh.use_mesh(mesh):
        logits = call(model)
        before = float(step(model, optimizer))
        after = float(loss_of(call(model)))
    params = linen_params(model)
    out["gpt"] = {
        "specs": {k: specs(params)[k] for k in ("wte/embedding", "h_0/mlp/wi/kernel",
                                                "h_0/self_attn/query/kernel", "h_0/norm1/scale")},
        "logits_max_diff": float(np.abs(np.asarray(logits) - np.asarray(call(single))).max()),
        "logits_sharding": spec_text(logits.sharding.spec),
        "loss": [before, after],
        "mu_spec": specs(nnx.state(optimizer))["opt_state/0/mu/h_0/mlp/wi/kernel/value"],
    }
    return out


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(main()))
