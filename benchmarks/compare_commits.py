"""This checkout against an earlier commit, in one process: train steps and decoding.

The package as it was at ``REV`` is exported (``git archive``) under another name,
``transformer_jax_at_REV``, and imported beside this checkout's ``transformer_jax``. Both
build the same model from the same config, batch and AdamW (the earlier package's own
``create_train_state``/``make_train_step``/``make_optimizer``, and the same loss written
here), and their jitted train steps alternate call by call, so that the machine's drift
over minutes, larger than most changes on a shared 2-core CPU, moves both sides alike.
Reported per case: the median step time of each side and the median and quartiles of each
round's ratio (earlier / this: > 1 means this checkout is faster), and the first loss of
both (they must agree). ``--decode`` does the same for ``decode.generate`` on GPT-2 124M
(greedy, 32 + 128 tokens; the tokens must be identical).

Usage::

    python -m benchmarks.compare_commits 35c27ea                  # the five cases, ~6 min
    python -m benchmarks.compare_commits 35c27ea --cases gpt6 --rounds 30 --decode

Results: a table on stdout. A case whose model or API did not exist at ``REV`` fails with
that package's error.
"""
from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

# name -> (model class, config fields, (input kind, batch, length, vocab or classes))
CASES = {
    "gpt4": ("GPT", dict(vocab_size=259, max_len=128, num_layers=4, num_heads=4, d_model=128,
                         dropout_rate=0.0, attention_dropout_rate=0.0), ("ids", 32, 128, 259)),
    "gpt6": ("GPT", dict(vocab_size=8192, max_len=256, num_layers=6, num_heads=6, d_model=384,
                         dropout_rate=0.0, attention_dropout_rate=0.0), ("ids", 8, 256, 8192)),
    "bert6": ("Bert", dict(vocab_size=8192, max_len=128, num_layers=6, num_heads=6, d_model=384,
                           head="mlm", dropout_rate=0.0, attention_dropout_rate=0.0),
              ("ids", 16, 128, 8192)),
    "t5": ("T5", dict(vocab_size=8192, d_model=384, num_heads=6, head_dim=64, mlp_dim=1536,
                      num_layers=4, dropout_rate=0.0), ("pair", 16, 64, 8192)),
    "vit12": ("ViT", dict(image_size=64, patch_size=8, num_classes=10, num_layers=12,
                          num_heads=3, d_model=192), ("images", 16, 64, 10)),
}
DEFAULT_CASES = "gpt4,gpt6,bert6,t5,vit12"
TINY = {"gpt_tiny": ("GPT", dict(vocab_size=64, max_len=16, num_layers=1, num_heads=2, d_model=16,
                                 dropout_rate=0.0, attention_dropout_rate=0.0),
                     ("ids", 2, 16, 64))}      # for the test of this script
CASES.update(TINY)


def export(rev: str, into: Path) -> str:
    """The package at ``rev`` as ``transformer_jax_at_<rev>`` under ``into``; its name."""
    name = "transformer_jax_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "transformer_jax"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "transformer_jax").rename(into / name)
    return name


def inputs(kind: tuple, rng: np.random.Generator):
    """(model inputs, labels) of one case."""
    what, batch, length, vocab = kind
    if what == "images":
        images = rng.normal(size=(batch, length, length, 3)).astype(np.float32)
        return (jnp.asarray(images),), jnp.asarray(rng.integers(0, vocab, (batch,)), jnp.int32)
    ids = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    return ((ids, ids) if what == "pair" else (ids,)), ids


def loss_fn(apply_fn, params, batch, rngs, deterministic, smoothing):
    logits = apply_fn({"params": params}, *batch["inputs"], deterministic=deterministic, rngs=rngs)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
    return jnp.sum(nll), {"weight": jnp.float32(nll.size), "nll": jnp.sum(nll)}


def train_call(package: str, case: str):
    """A call that runs one jitted train step of ``case`` with ``package`` and waits."""
    family, fields, kind = CASES[case]
    models = importlib.import_module(f"{package}.models")
    step_lib = importlib.import_module(f"{package}.train.step")
    optim = importlib.import_module(f"{package}.train.optim")
    model = getattr(models, family)(getattr(models, f"{family}Config")(**fields))
    args, labels = inputs(kind, np.random.default_rng(0))
    tx = optim.make_optimizer(schedule=optim.constant(1e-4), b1=0.9, b2=0.98, eps=1e-9,
                              weight_decay=0.01, clip_norm=1.0)
    holder = {"state": step_lib.create_train_state(model, tx, jax.random.PRNGKey(0), *args)}
    step = jax.jit(step_lib.make_train_step(loss_fn=loss_fn), donate_argnums=(0,))
    batch = {"inputs": args, "labels": labels}

    def call():
        holder["state"], metrics = step(holder["state"], batch)
        return float(metrics["loss"])
    return call


def alternate(before, after, rounds: int) -> dict:
    """Median seconds of each side and the median and quartiles of each round's
    before/after ratio (``common.alternate``: calls alternating, the first one rotating)."""
    times = common.alternate({"before": before, "after": after}, rounds, warmup=0)
    r = common.round_ratios(times["before"], times["after"])
    return {"before_s": statistics.median(times["before"]),
            "after_s": statistics.median(times["after"]), "ratio": r["median"], "q1": r["q1"],
            "q3": r["q3"]}


def compare_train(old: str, case: str, rounds: int) -> dict:
    before, after = train_call(old, case), train_call("transformer_jax", case)
    losses = (before(), after())
    for _ in range(2):
        before(), after()
    return {"case": case, "first_loss": losses, **alternate(before, after, rounds)}


def compare_decode(old: str, batch: int, rounds: int) -> dict:
    calls, tokens = {}, {}
    fields = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
    new_models = importlib.import_module("transformer_jax.models")
    model = new_models.GPT(new_models.GPTConfig.preset("gpt2", **fields))
    params = jax.jit(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32))["params"])(
        jax.random.PRNGKey(0))
    prompt = np.random.default_rng(batch).integers(0, 50257, (batch, 32)).astype(np.int32)
    for side, package in (("before", old), ("after", "transformer_jax")):
        models = importlib.import_module(f"{package}.models")
        decode = importlib.import_module(f"{package}.decode")
        m = models.GPT(models.GPTConfig.preset("gpt2", **fields))
        calls[side] = lambda m=m, decode=decode: np.asarray(
            decode.generate(m, params, prompt, max_new_tokens=128))
        tokens[side] = calls[side]()
    identical = bool((tokens["before"] == tokens["after"]).all())
    return {"case": f"decode GPT-2 124M, batch {batch}", "identical": identical,
            **alternate(calls["before"], calls["after"], rounds)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the earlier commit (anything git rev-parse takes)")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"subset of {','.join(CASES)}")
    p.add_argument("--rounds", type=int, default=16, help="alternating rounds per case")
    p.add_argument("--decode", action="store_true", help="also decode.generate, batch 1 and 16")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = export(args.rev, Path(tmp))
        sys.path.insert(0, tmp)
        info = common.machine_info()
        print(f"{info['date']}: {info['cpu']} ({info['cpu_isa']}), {info['cpu_count']} cores, "
              f"jax {info['jax']}")
        print(f"| case | {args.rev} ms | this ms | {args.rev}/this per round (quartiles) | check |")
        print("|---|---:|---:|---:|---|")
        rows = [compare_train(old, c, args.rounds) for c in args.cases.split(",")]
        if args.decode:
            rows += [compare_decode(old, b, max(3, args.rounds // 3)) for b in (1, 16)]
        for r in rows:
            check = (f"losses {r['first_loss'][0]:.6f} / {r['first_loss'][1]:.6f}"
                     if "first_loss" in r else f"tokens identical: {r['identical']}")
            print(f"| {r['case']} | {1e3 * r['before_s']:,.1f} | {1e3 * r['after_s']:,.1f} | "
                  f"{r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | {check} |", flush=True)


if __name__ == "__main__":
    main()
