"""Small helpers shared by test files: random arrays, tolerances, attention inputs, the
smallest training run, the numeric fields of a config and their probes, lowered program
text."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 has an 8-bit mantissa: inputs, weights and outputs are each rounded to ~3e-3 relative.
# With fp32 softmax and fp32 accumulation, attention outputs of unit-scale inputs stay
# within 2e-2 absolute of the fp32 result; this is the library's documented bf16 tolerance.
BF16_ATOL = 2e-2


def rand(key, shape, dtype=jax.numpy.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def attention_inputs(n=8, kv=2, t=37, s=53, h=16):
    """q (2, T, N, H), k and v (2, S, K, H), a random padding-and-more mask (2, 1, T, S)
    and a bias (1, N, T, S)."""
    q, k, v = rand(0, (2, t, n, h)), rand(1, (2, s, kv, h)), rand(2, (2, s, kv, h))
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 1, t, s))
    bias = rand(4, (1, n, t, s))
    return q, k, v, mask, bias


# The smallest run the training-loop tests train: a 1-layer GPT of width 32 on the embedded corpus.
TINY_RUN = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=64",
    "seq_len=32", "batch_size=4", "schedule=constant", "learning_rate=3e-3", "warmup_steps=2",
    "log_every=1", "eval_every=5", "save_every=5", "eval_batches=2", "sample_tokens=8",
]


def tiny_cfg(data_dir, **extra):
    """TINY_RUN in ``data_dir``, with ``extra`` as further ``--set key=value`` overrides."""
    from transformer_jax.train.config import ExperimentConfig, apply_overrides
    return apply_overrides(ExperimentConfig(), TINY_RUN + [f"data_dir={data_dir}"]
                           + [f"{k}={v}" for k, v in extra.items()])


def cli(*args, preexec_fn=None, env=None):
    """``transformer-jax ARGS`` in a subprocess: (exit status, stdout, the warning:/error: lines)."""
    env = dict(os.environ if env is None else env, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-m", "transformer_jax.cli", *args], capture_output=True,
                          text=True, env=env, preexec_fn=preexec_fn, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])   # the repository
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith(("warning:", "error:"))]
    return done.returncode, done.stdout, lines


def cli_here(*args, capfd=None, caplog=None):
    """``transformer-jax ARGS`` through ``transformer_jax.cli.main`` in this process, reported
    as :func:`cli` reports a subprocess: (exit status, stdout, the warning:/error: lines).
    For runs that need no process of their own (no signal, resource limit, capability or
    fresh import): it saves the interpreter's start and imports, and reuses the programs
    this process has compiled. With a test's ``capfd`` the output is read at the file
    descriptors, so what C++ writes counts too, and with its ``caplog`` a logged traceback
    fails the call as a printed one does (logging goes to stderr in a subprocess, to pytest
    here); without them (a module-scoped fixture) Python's ``sys.stdout``/``sys.stderr``."""
    import contextlib
    import io

    from transformer_jax.cli import main

    argv = [str(a) for a in args]
    if capfd is None:
        with contextlib.redirect_stdout(io.StringIO()) as o, contextlib.redirect_stderr(io.StringIO()) as e:
            code = main(argv)
        out, err = o.getvalue(), e.getvalue()
    else:
        capfd.readouterr()
        code = main(argv)
        out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    assert caplog is None or "Traceback" not in caplog.text, caplog.text
    lines = [line for line in err.splitlines() if line.startswith(("warning:", "error:"))]
    return code, out, lines


def snapshot(workdir) -> dict[str, bytes]:
    """Every file under ``workdir`` (relative path -> bytes; ``b"<dir>"`` for a directory):
    what a refused run must leave as it was."""
    root = Path(workdir)
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(root.rglob("*"))}


def numeric_fields(cls) -> dict[str, bool]:
    """name -> whether it is an int field, for every field of the dataclass ``cls`` annotated
    int or float (also ``int | None``)."""
    out = {}
    for f in dataclasses.fields(cls):
        kinds = set(re.findall(r"\b(int|float)\b", str(f.type)))
        if kinds:
            out[f.name] = kinds == {"int"}
    return out


def probes(is_int: bool) -> dict[str, object]:
    """The values a numeric config field is probed with: zero, a negative, a float where an
    int belongs, a string."""
    if is_int:
        return {"zero": 0, "negative": -1, "float": 1.5, "string": "abc"}
    return {"zero": 0.0, "negative": -0.5, "string": "abc"}


def lowered_text(fn, args, platform: str) -> str:
    """StableHLO of ``jax.jit(fn)(*args)`` lowered for ``platform`` ("cpu", "cuda", "tpu")
    from this host, after MLIR's canonicaliser has folded the ``lax.platform_dependent``
    selectors (a case on a constant index), so what is left is what that platform runs.
    Nested jitted functions stay functions (``func.call``); :func:`custom_calls` counts
    through them."""
    from jax._src.lib.mlir import ir, passmanager

    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    module = lowered.compiler_ir("stablehlo")
    with module.context:
        module = ir.Module.parse(str(module))
        passmanager.PassManager.parse("builtin.module(canonicalize)").run(module.operation)
    return str(module)


def custom_calls(text: str) -> list[str]:
    """Target names of the custom calls a StableHLO module executes, once per execution:
    a function called from two places counts twice (counted from ``@main`` through every
    ``func.call``)."""
    import re
    bodies, name = {}, None
    for line in text.splitlines():
        head = re.match(r"\s*func\.func (?:public |private )?@([\w$.\-]+)\(", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    def expand(fn: str) -> list[str]:
        out = []
        for line in bodies.get(fn, ()):
            out += re.findall(r"custom_call @([\w$.\-]+)", line)
            for callee in re.findall(r"\bcall @([\w$.\-]+)\(", line):
                out += expand(callee)
        return out

    return expand("main")


def assert_packed_like_alone(fn, params, streams: dict, vocab: int, *, pad: int = 2, seed=0):
    """Packed documents give each document exactly the logits and the loss gradients it gets
    alone in its own padded row. ``streams``: name -> document lengths (the k-th documents of
    all streams belong together, e.g. an encoder's and a decoder's). ``fn(params, {name:
    (ids, segment_ids, positions, mask)})`` -> logits (B, T, V) of the last stream, called
    twice: packed, each stream one row (its documents, then ``pad`` padding tokens) with
    segment ids and positions (mask None); alone, one row per document, right-padded to the
    longest, with its padding mask (1 = real token; segment ids and positions None). The
    rows alone go in one batch: their loss is the sum of the documents' losses."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(seed)
    packed, alone, parts = {}, {}, {}
    for name, lengths in streams.items():
        total = sum(lengths) + pad
        ids = rng.integers(3, vocab, (1, total)).astype(np.int32)
        seg = np.zeros((1, total), np.int32)
        pos = np.zeros((1, total), np.int32)
        solo = np.zeros((len(lengths), max(lengths)), np.int32)
        mask = np.zeros_like(solo)
        parts[name], start = [], 0
        for k, n in enumerate(lengths):
            seg[0, start:start + n], pos[0, start:start + n] = k + 1, np.arange(n)
            solo[k, :n], mask[k, :n] = ids[0, start:start + n], 1
            parts[name].append(slice(start, start + n))
            start += n
        packed[name] = (jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos), None)
        alone[name] = (jnp.asarray(solo), None, None, jnp.asarray(mask))
    out = list(streams)[-1]
    targets = rng.integers(0, vocab, packed[out][0].shape).astype(np.int32)
    solo_targets = np.zeros(alone[out][0].shape, np.int32)
    for k, part in enumerate(parts[out]):
        solo_targets[k, :part.stop - part.start] = targets[0, part]

    def loss(params, inputs, targets, weights):
        logp = jax.nn.log_softmax(fn(params, inputs), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights)

    fn, grad = jax.jit(fn), jax.jit(jax.grad(loss))
    logits = fn(params, packed)
    grads = grad(params, packed, jnp.asarray(targets), (packed[out][1] > 0).astype(jnp.float32))
    logits_alone = fn(params, alone)
    grads_alone = grad(params, alone, jnp.asarray(solo_targets),
                       alone[out][3].astype(jnp.float32))
    for k, part in enumerate(parts[out]):
        np.testing.assert_allclose(logits[0, part], logits_alone[k, :part.stop - part.start],
                                   rtol=2e-5, atol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_alone)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def assert_encoder_decoder_packed(model, params, vocab: int):
    """An encoder-decoder (T5, Transformer) over two source/target pairs packed into one row
    each: ``assert_packed_like_alone`` (encoder self-attention, causal decoder self-attention
    and cross-attention stay within each pair; positions restart per document), and the
    refusals of half-given segment ids and of segment ids in a decode step."""
    import jax.numpy as jnp
    import pytest

    from transformer_jax.errors import UserError

    def fn(params, inputs):
        (src, src_seg, src_pos, src_mask), (tgt, tgt_seg, tgt_pos, tgt_mask) = \
            inputs["source"], inputs["target"]
        return model.apply({"params": params}, src, tgt, src_mask, tgt_mask,
                           segment_ids=src_seg, positions=src_pos,
                           decoder_segment_ids=tgt_seg, decoder_positions=tgt_pos)

    assert_packed_like_alone(fn, params, {"source": (4, 7), "target": (6, 3)}, vocab)
    ids, seg = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    with pytest.raises(UserError, match="segment ids for both the source"):
        model.apply({"params": params}, ids, ids, segment_ids=seg)
    encoded = jnp.zeros((1, 4, model.config.d_model))      # refused before it is read
    with pytest.raises(UserError, match="not for decode=True"):
        model.apply({"params": params}, ids[:, :1], encoded, segment_ids=seg[:, :1],
                    memory_segment_ids=seg, decode=True, method=model.decode, mutable=["cache"])


def assert_chunked_loss_matches(loss_fn, apply_fn, params, batch, *, smoothing=0.1, chunk=5):
    """A task loss with ``loss_chunk=chunk`` against the plain one on a model: loss, named
    sums and the gradient within 1e-6 relative (float32, "highest" matmuls; each parameter's
    within 1e-5). Returns the plain loss and gradients."""
    import numpy as np

    def run(loss_chunk):
        def objective(p):
            return loss_fn(apply_fn, p, batch, None, True, smoothing, loss_chunk=loss_chunk)
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(objective, has_aux=True))(params)

    (want, want_sums), want_g = run(0)
    (got, got_sums), got_g = run(chunk)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert set(got_sums) == set(want_sums)
    for name in want_sums:
        np.testing.assert_allclose(float(got_sums[name]), float(want_sums[name]), rtol=1e-6,
                                   err_msg=name)
    flat_want = jax.tree_util.tree_leaves_with_path(want_g)
    flat_got = jax.tree_util.tree_leaves(got_g)
    assert len(flat_want) == len(flat_got)
    norm = lambda x: float(jax.numpy.linalg.norm(x.ravel()))  # noqa: E731
    diffs = [norm(g - w) for (_, w), g in zip(flat_want, flat_got)]
    sizes = [norm(w) for _, w in flat_want]
    # the whole gradient: 1e-6 relative (Frobenius norm over every parameter)
    assert sum(d * d for d in diffs) ** 0.5 <= 1e-6 * sum(n * n for n in sizes) ** 0.5
    # each parameter's: 1e-5 (float32 rounding grows through the layers), plus 1e-7 of the
    # largest (a gradient that is zero in exact arithmetic, an attention key's bias, is noise)
    for (path, _), d, n in zip(flat_want, diffs, sizes):
        assert d <= 1e-5 * n + 1e-7 * max(sizes), (jax.tree_util.keystr(path), d, n)
    return float(want), want_g
