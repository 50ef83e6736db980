"""Subprocess side of tests/train/test_loss_scale.py: dynamic loss scaling on 4 simulated
CPU devices, under the jit (data=4) and pmap placements, against one device.

  python tests/train/loss_scale_worker.py   -> last stdout line: one JSON object

Two starts of the same float16 GPT: scale 2**40 (every gradient overflows: the step must
be skipped) and scale 2**10 (two ordinary steps). The device count must be fixed before
JAX starts, so this file sets ``XLA_FLAGS`` itself when the caller has not.
"""
from __future__ import annotations

import json
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 4 devices (under pytest the caller sets them, beside tests/conftest.py's compile flags)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from transformer_jax import sharding as sh  # noqa: E402
from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train.distributed import JitPlacement, PmapPlacement  # noqa: E402
import optax  # noqa: E402
from transformer_jax.train.step import LossScale, compile_train_step, create_train_state, make_train_step  # noqa: E402


def setup():
    model = GPT(GPTConfig.preset("tiny", num_layers=1, d_model=64, num_heads=4, max_len=32,
                                 dtype="float16", dropout_rate=0.0, attention_dropout_rate=0.0))
    ids = np.random.default_rng(0).integers(0, 512, (8, 17)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": np.ones((8, 16), np.float32)}
    # plain SGD with rate 1: a step moves the parameters by exactly minus the gradient
    return model, optax.sgd(1.0), batch


def host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def creator(model, tx, scale):
    rng, init_args = jax.random.PRNGKey(0), (jnp.zeros((1, 16), jnp.int32),)
    return lambda: create_train_state(model, tx, rng, *init_args,  # noqa: E731
                                      loss_scale=LossScale.create(scale, growth_interval=2000))


def compiled_step(place, model, tx):
    """The train step for ``place`` (None: one device, no mesh), compiled once and used for
    both starts (the scale is a value in the state, not part of the program)."""
    if place is None:
        return jax.jit(make_train_step())
    init_args = (jnp.zeros((1, 16), jnp.int32),)
    place.setup(creator(model, tx, 1.0), lambda: model.init(jax.random.PRNGKey(0), *init_args))
    return compile_train_step(place, make_train_step(axis_name=place.axis_name))


def run(place, step, model, tx, batch, scale, steps):
    """``steps`` steps from the fresh state; per step its metrics and the (global) state."""
    create = creator(model, tx, scale)
    state = jax.jit(create)() if place is None else place.init_state(create, tx, lambda p: p)
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        replicas_agree = True
        if isinstance(place, PmapPlacement):   # every device kept the same state
            leaves = jax.tree_util.tree_leaves(host(state))
            replicas_agree = all(bool((x == x[:1]).all()) for x in leaves)
        glob = state if place is None else place.to_checkpoint(state)
        out.append((host(metrics), host(glob), replicas_agree))
    return out


def compare(got, want, init) -> dict:
    """The step's flags and scale; its update (minus the gradient) against one device's,
    relative to the largest entry of one device's."""
    (m, s, agree), (m_ref, s_ref, _) = got, want
    leaves = jax.tree_util.tree_leaves
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))  # noqa: E731
    update = [x.astype(np.float64) - p for x, p in zip(leaves(s.params), leaves(init))]
    update_ref = [x.astype(np.float64) - p for x, p in zip(leaves(s_ref.params), leaves(init))]
    top = max(float(np.max(np.abs(u))) for u in update_ref)
    return {"skipped": float(m["skipped"]), "loss_scale_used": float(m["loss_scale"]),
            "scale_after": float(s.loss_scale.scale), "good_steps": int(s.loss_scale.good_steps),
            "loss_rel": abs(float(m["loss"]) - float(m_ref["loss"])) / abs(float(m_ref["loss"])),
            "update_rel": (max(float(np.max(np.abs(u - r))) for u, r in zip(update, update_ref)) / top
                           if top else 0.0),
            "params_equal_init": same(s.params, init),
            "opt_state_equal_reference": same(s.opt_state, s_ref.opt_state),
            "replicas_agree": agree}


def main() -> dict:
    model, tx, batch = setup()
    out = {"devices": jax.device_count()}
    fresh = host(jax.jit(lambda: create_train_state(model, tx, jax.random.PRNGKey(0),
                                                    jnp.zeros((1, 16), jnp.int32)))())
    places = {"jit data=4": JitPlacement("data=4", 8), "pmap": PmapPlacement(None, 8)}
    steps_of = {name: compiled_step(place, model, tx) for name, place in places.items()}
    ref_step = compiled_step(None, model, tx)
    for scale, steps in ((2.0 ** 40, 1), (2.0 ** 10, 2)):
        ref = run(None, ref_step, model, tx, batch, scale, steps)
        for name, place in places.items():
            got = run(place, steps_of[name], model, tx, batch, scale, steps)
            # each step's update is measured from the state before it
            befores = [fresh.params] + [g[1].params for g in got[:-1]]
            out[f"{name} scale 2**{int(np.log2(scale))}"] = [
                compare(g, r, b) for g, r, b in zip(got, ref, befores)]
    out["mesh_devices"] = int(sh.make_mesh("data=4").size)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
