"""Subprocess side of tests/test_sharding.py: runs on 8 simulated CPU devices.

  python tests/sharding_worker.py parity            -> JSON: loss/gradient differences per case,
                                                       state bytes and specs per layout
  python tests/sharding_worker.py curves ROOT DATA  -> JSON: train() losses per mesh + resumes

The device count must be fixed before JAX starts, so this file sets ``XLA_FLAGS`` itself
(``--xla_force_host_platform_device_count=8``) when the caller has not. The last line of
stdout is one JSON object; the test asserts on it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 devices (under pytest the caller sets them, beside tests/conftest.py's compile flags)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from transformer_jax import sharding as sh  # noqa: E402
from transformer_jax.models import (Bert, BertConfig, CLIP, CLIPConfig, GPT, GPTConfig, T5,  # noqa: E402
                                    T5Config)
from transformer_jax.tasks.contrastive import contrastive_loss  # noqa: E402
from transformer_jax.tasks.pretrain import pretraining_loss  # noqa: E402
from transformer_jax.train.distributed import JitPlacement, PmapPlacement  # noqa: E402
from transformer_jax.losses import lm_loss, token_loss  # noqa: E402
from transformer_jax.train.finetune import ParamSplit  # noqa: E402
from transformer_jax.train.step import compile_train_step, create_train_state, make_train_step  # noqa: E402

# train() end to end: the mixed mesh (data, fsdp and tensor at once), 8-way FSDP (which the
# test then resumes on one device) and pmap; data=8 runs as the target of both resumes
CURVE_MESHES = ["fsdp=8", "data=2,fsdp=2,tensor=2"]


def gradient_catcher() -> optax.GradientTransformation:
    """An 'optimizer' whose state becomes the gradient and whose update is zero: after one
    step, ``state.opt_state`` holds exactly the gradient the step computed (sharded like
    the parameters, which exercises the optimizer-state shardings)."""
    zeros = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)  # noqa: E731
    return optax.GradientTransformation(init=zeros, update=lambda g, s, p=None: (zeros(g), g))


def t5_loss(apply_fn, params, batch, rngs, deterministic, smoothing):
    logits = apply_fn({"params": params}, batch["inputs"], batch["decoder_inputs"],
                      deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["targets"], batch["weights"], smoothing)


def families():
    rng = np.random.default_rng(0)
    b, t = 16, 16
    gpt = GPT(GPTConfig.preset("tiny", num_layers=1, d_model=64, num_heads=8, max_len=32, dropout_rate=0.1,
                               attention_dropout_rate=0.1))
    ids = rng.integers(0, 512, (b, t + 1)).astype(np.int32)
    w = np.ones((b, t), np.float32)
    w[3, 9:] = 0.0
    gpt_batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": w}
    t5 = T5(T5Config.preset("tiny", num_layers=1, num_heads=8, head_dim=8, dropout_rate=0.1))
    src = rng.integers(2, 512, (b, 12)).astype(np.int32)
    tgt = rng.integers(2, 512, (b, t + 1)).astype(np.int32)
    t5_batch = {"inputs": src, "decoder_inputs": tgt[:, :-1], "targets": tgt[:, 1:], "weights": w}
    lora = GPT(gpt.config.replace(lora=dict(rank=4, targets="attn/|mlp/"), dropout_rate=0.0,
                                  attention_dropout_rate=0.0))
    # CLIP's loss scores every image against every caption of the global batch: the meshes
    # gather the embeddings, pmap gathers them itself (tasks/contrastive.py)
    clip = CLIP(CLIPConfig.preset("tiny", vocab_size=300, max_len=t, eos_token_id=1, pad_token_id=0))
    cc = clip.config
    caption = rng.integers(3, 300, (b, t)).astype(np.int32)
    caption[np.arange(b), rng.integers(4, t, b)] = 1                 # the end of text, pooled
    images = rng.standard_normal((b, cc.image_size, cc.image_size, cc.num_channels)).astype(np.float32)
    weights = np.ones((b,), np.float32)
    weights[-3:] = 0.0                                               # padding: neither query nor negative
    clip_batch = {"input_ids": caption, "attention_mask": np.ones((b, t), np.int32),
                  "images": images, "weights": weights}
    # BERT pretraining: the MLM mean is over the whole batch's masked tokens, which the
    # devices hold in unequal numbers (pmap sums the counts first)
    bert = Bert(BertConfig.preset("tiny", head="pretraining", max_len=t))
    masked = rng.random((b, t)) < np.linspace(0.05, 0.6, b)[:, None]
    nsp = rng.integers(0, 2, b).astype(np.int32)
    nsp[-2:] = -100                                                  # no pair: eval padding
    bert_batch = {"input_ids": rng.integers(0, 512, (b, t)).astype(np.int32),
                  "token_type_ids": (np.arange(t) >= t // 2).astype(np.int32)[None].repeat(b, 0),
                  "attention_mask": np.ones((b, t), np.int32),
                  "targets": rng.integers(0, 512, (b, t)).astype(np.int32),
                  "weights": masked.astype(np.float32), "nsp_labels": nsp}
    return {
        "bert_pretrain": (bert, pretraining_loss, bert_batch, (jnp.zeros((1, t), jnp.int32),)),
        "gpt": (gpt, lm_loss, gpt_batch, (jnp.zeros((1, t), jnp.int32),)),
        # LoRA: the adapters train (state.params), the base is state.frozen
        "gpt_lora": (lora, lm_loss, gpt_batch, (jnp.zeros((1, t), jnp.int32),)),
        "t5": (t5, t5_loss, t5_batch, (jnp.zeros((1, 12), jnp.int32), jnp.zeros((1, t), jnp.int32))),
        "clip": (clip, contrastive_loss, clip_batch,
                 (jnp.zeros((1, t), jnp.int32), jnp.zeros(images[:1].shape, jnp.float32))),
    }


def deterministic(loss_fn):
    """The same loss with dropout off (a loss over the global batch stays one)."""
    def loss(apply_fn, params, batch, rngs, det, smoothing, **kw):
        return loss_fn(apply_fn, params, batch, rngs, True, smoothing, **kw)
    loss.global_batch = getattr(loss_fn, "global_batch", False)
    return loss


def compare(state, metrics, ref_state, ref_metrics) -> dict:
    """Relative differences of loss, grad norm and gradients. A gradient leaf's error is
    relative to its largest entry, floored at 1e-3 of the largest entry of any leaf (the
    key projection's bias has a true gradient of zero: softmax ignores it)."""
    grads = [np.asarray(g, np.float64) for g in jax.tree_util.tree_leaves(jax.device_get(state.opt_state))]
    ref = [np.asarray(g, np.float64) for g in jax.tree_util.tree_leaves(jax.device_get(ref_state.opt_state))]
    top = max(np.max(np.abs(r)) for r in ref)
    return {"loss": abs(float(metrics["loss"]) - float(ref_metrics["loss"])) / abs(float(ref_metrics["loss"])),
            "grad_norm": abs(float(metrics["grad_norm"]) - float(ref_metrics["grad_norm"])) / float(ref_metrics["grad_norm"]),
            "grads": max(float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-3 * top))
                         for g, r in zip(grads, ref))}


# The cases each family's train step runs in, with dropout (jit meshes only: pmap draws
# per-device masks) and without. The mixed mesh shards over data, fsdp and tensor at once;
# the pure layouts and pmap run for GPT; the other families add what is theirs: T5's
# relative position bias and cross attention (the mixed mesh, with dropout; pmap), LoRA's
# adapters, CLIP's contrastive loss and BERT's masked-token mean over the global batch
# (pmap gathers the embeddings / sums the counts itself).
CASES = {
    "gpt": {True: ["data=2,fsdp=2,tensor=2", "data=2,fsdp=2,tensor=2/accum2"],
            False: ["data=8", "fsdp=8", "tensor=8", "pmap"]},
    "t5": {True: ["data=2,fsdp=2,tensor=2"], False: ["pmap"]},
    "gpt_lora": {True: [], False: ["data=2,fsdp=2,tensor=2", "pmap"]},   # adapters train
    "clip": {True: [], False: ["data=2,fsdp=4", "pmap"]},
    "bert_pretrain": {True: [], False: ["pmap"]},
}
# Where the state lives per device (no step needed: the jit step's output keeps the
# placement's shardings, which the stepped cases check)
LAYOUTS = {"gpt": ["data=8", "data=2,fsdp=4", "fsdp=8", "tensor=8"],
           "t5": ["data=8", "data=2,fsdp=4", "fsdp=8", "tensor=8"]}


def state_layout(state) -> dict:
    """Bytes of parameters + optimizer state on the fullest device and in all, and the
    sharding spec of every parameter (LoRA: the frozen base's as ``frozen/...``)."""
    mem = sh.bytes_per_device((state.params, state.opt_state))
    specs = {"/".join(sh._path(p)): str(x.sharding.spec)
             for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    specs.update({"frozen/" + "/".join(sh._path(p)): str(x.sharding.spec)
                  for p, x in jax.tree_util.tree_flatten_with_path(state.frozen or {})[0]})
    return {"state_bytes_max_device": max(mem.values()),
            "state_bytes_total": sum(x.nbytes for x in jax.tree_util.tree_leaves((state.params, state.opt_state))),
            "specs": specs}


def parity() -> dict:
    tx = gradient_catcher()
    rng = jax.random.PRNGKey(0)
    out: dict = {"devices": jax.device_count(), "layouts": {}}
    for name, (model, loss_fn, batch, init_args) in families().items():
        split = ParamSplit(lora=model.config.lora) if model.config.lora is not None else None
        create = lambda: create_train_state(  # noqa: E731
            model, tx, rng, *init_args, partition=split and split.split)
        init_vars = lambda: model.init(rng, *init_args)  # noqa: E731
        rows = len(next(iter(batch.values())))
        fresh = jax.jit(create)()
        host = jax.device_get(fresh)   # the same initial values, placed per case (the step donates)
        res: dict = {}
        for dropout in (True, False):
            cases = CASES[name][dropout]
            if not cases:
                continue
            lf = loss_fn if dropout else deterministic(loss_fn)
            ref_state, ref_m = jax.jit(make_train_step(loss_fn=lf))(fresh, batch)  # 1 device, no mesh
            # dropout masks do not depend on the sharding (threefry is partitionable), so the
            # jit meshes match with dropout on
            for case in cases:
                spec, _, extra = case.partition("/")
                accum = 2 if extra == "accum2" else 1
                if spec == "pmap":
                    place = PmapPlacement(None, rows)
                    fn = make_train_step(loss_fn=lf, axis_name=place.axis_name)
                else:
                    place = JitPlacement(spec, rows, accum)
                    fn = make_train_step(loss_fn=lf, accum_steps=accum)
                place.setup(create, init_vars)
                # train() covers Placement.init_state
                state = sh.pmap_replicate(host) if spec == "pmap" else sh.put_global(host, place._shardings)
                state, m = compile_train_step(place, fn)(state, batch)
                if spec == "pmap":
                    state = sh.pmap_to_global(state, place.mesh)
                ref_s, ref_mm = (ref_state, ref_m)
                if accum == 2:   # accumulation draws other dropout masks: compare with accum on one device
                    ref_s, ref_mm = jax.jit(make_train_step(loss_fn=loss_fn, accum_steps=2))(fresh, batch)
                r = compare(state, m, ref_s, ref_mm)
                r.update(state_layout(state))
                res[f"{case}{'' if dropout else ' (no dropout)'}"] = r
        out[name] = res
        layouts = {}
        for spec in LAYOUTS.get(name, []):
            place = JitPlacement(spec, rows)
            place.setup(create, init_vars)
            layouts[spec] = state_layout(sh.put_global(host, place._shardings))
        if layouts:
            out["layouts"][name] = layouts
    return out


def curves(root: str, data_dir: str) -> dict:
    from transformer_jax.train.config import ExperimentConfig, apply_overrides
    from transformer_jax.run import train
    from transformer_jax.train.monitor import read_metrics

    overrides = json.loads(os.environ["SHARDING_TEST_OVERRIDES"]) + [f"data_dir={data_dir}"]
    cfg = apply_overrides(ExperimentConfig(), overrides)
    steps = cfg.steps

    def losses(workdir):
        return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}

    def run(name, workdir=None, resume=False, **changes):
        workdir = workdir or os.path.join(root, name)
        train(cfg.replace(**changes), workdir, resume=resume, progress=False)
        return losses(workdir)

    out = {"runs": {}, "resumed": {}}
    for mesh in CURVE_MESHES:
        out["runs"][mesh] = run(mesh, mesh=mesh)
    out["runs"]["pmap"] = run("pmap", parallelism="pmap")
    # restores onto another mesh: cut a finished run back to its middle checkpoint, resume
    # (the test resumes the fsdp=8 one on a single device)
    half = steps // 2
    for src, dst_changes, name in [("data=2,fsdp=2,tensor=2", dict(mesh="data=8"), "data=2,fsdp=2,tensor=2 -> data=8"),
                                   ("pmap", dict(parallelism="jit", mesh="data=8"), "pmap -> jit data=8")]:
        workdir = os.path.join(root, f"resume_{len(out['resumed'])}")
        shutil.copytree(os.path.join(root, src), workdir)
        for d in os.listdir(os.path.join(workdir, "checkpoints")):
            if d.isdigit() and int(d) > half:
                shutil.rmtree(os.path.join(workdir, "checkpoints", d))
        out["resumed"][name] = run(name, workdir=workdir, resume=True, **dst_changes)
    return out


if __name__ == "__main__":
    what = sys.argv[1]
    result = parity() if what == "parity" else curves(*sys.argv[2:4])
    print(json.dumps(result))
