"""JAX's splash kernel (``layers/splash_attention.py``) against the reference, its choice by
``attention_dispatch``, and its compile by the real TPU compiler.

Off a TPU splash runs in interpret mode, which is slow: the shapes are the smallest splash
takes (blocks of 128), and each case computes the output and the q, k, v gradients in one
jitted function. fp32 throughout: outputs within 1e-5, gradients within 1e-4 of ``"xla"``
(the scale is folded into q before the kernel, which rounds differently).
"""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers import dot_product_attention
from transformer_jax.layers.attention_dispatch import choose_implementation, resolve_implementation
from transformer_jax.layers.masks import AttentionPattern, padding_mask_from_lengths
from transformer_jax.layers.splash_attention import (SPLASH_BLOCKS, SplashBlocks, _fit,
                                                     splash_attention, tpu_name)

from ..helpers import rand

OUT_TOL, GRAD_TOL = dict(rtol=0, atol=1e-5), dict(rtol=0, atol=1e-4)


def _inputs(b=2, t=128, s=None, n=4, kv=2, h=64):
    s = t if s is None else s
    return rand(0, (b, t, n, h)), rand(1, (b, s, kv, h)), rand(2, (b, s, kv, h))


def _out_and_grads(attend, q, k, v):
    """(out, dq, dk, dv) of sum(out * ct) in one jit."""
    ct = rand(3, q.shape[:3] + v.shape[-1:])

    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(ct))
    return jax.jit(run)(q, k, v)


def _agree(splash, reference, q, k, v):
    got, want = _out_and_grads(splash, q, k, v), _out_and_grads(reference, q, k, v)
    np.testing.assert_allclose(got[0], want[0], **OUT_TOL)
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        np.testing.assert_allclose(a, b, **GRAD_TOL, err_msg=name)


def _both(**kw):
    return [lambda q, k, v, impl=impl: dot_product_attention(q, k, v, attention_impl=impl, **kw)
            for impl in ("splash", "xla")]


def test_causal_grouped_query_heads():
    """4 query heads on 2 kv heads (splash's own grouping), causal, 128 tokens."""
    _agree(*_both(causal=True, scale=0.3), *_inputs())


def test_bidirectional_with_key_padding_and_uneven_lengths():
    """100 queries, 100 keys (padded to 128 inside); rows of 37 and 100 real keys, and a
    row with none (every query gets the mean of V, as the reference gives it)."""
    q, k, v = _inputs(b=3, t=100, n=2, kv=2)
    mask = padding_mask_from_lengths(jnp.array([37, 100, 0]), 100)
    _agree(*_both(mask=mask), q, k, v)


def test_causal_sliding_window_over_several_blocks():
    """A causal window of 40 over 256 tokens in blocks of 128: splash's LocalMask skips the
    key blocks outside it; also bidirectional (|i - j| < 40)."""
    q, k, v = _inputs(b=1, t=256, n=2, kv=1)
    window = AttentionPattern("window", 40)
    for causal in (True, False):
        splash = lambda q, k, v: splash_attention(  # noqa: E731
            q, k, v, causal=causal, pattern=window, interpret=True,
            blocks=SplashBlocks(128, 128, 128))
        xla = lambda q, k, v: dot_product_attention(  # noqa: E731
            q, k, v, causal=causal, pattern=window, attention_impl="xla")
        _agree(splash, xla, q, k, v)


def test_segment_ids_with_key_padding():
    """Packed documents (different cuts per row) and key padding on top, causal."""
    q, k, v = _inputs(b=2, t=128, n=2, kv=2)
    ids = jnp.stack([jnp.repeat(jnp.arange(3), jnp.array([50, 50, 28]), total_repeat_length=128),
                     jnp.repeat(jnp.arange(2), jnp.array([10, 118]), total_repeat_length=128)])
    mask = padding_mask_from_lengths(jnp.array([128, 90]), 128)
    _agree(*_both(causal=True, segment_ids=ids, mask=mask), q, k, v)


def test_auto_takes_splash_on_tpu_where_it_expresses_the_call():
    """"auto" on a TPU v4+ (or an unknown one): splash for causal/bidirectional, key
    padding, segment ids, a window; our Pallas kernel for a bias, a general mask, a sparse
    pattern; v2/v3 and the CPU and GPU as before. Explicit "splash" refuses what it cannot
    express, v3, and GPUs, by name."""
    c = choose_implementation
    window, strided = AttentionPattern("window", 256), AttentionPattern("strided", 64)
    for generation in (4, 5, 6, 7, None):
        assert resolve_implementation("auto", "tpu", tpu_generation=generation) == "splash"
        assert resolve_implementation("auto", "tpu", tpu_generation=generation,
                                      mask="keys", pattern=window) == "splash"
    assert c("auto", "tpu", mask="keys") == (
        "splash", "no bias, a mask it expresses (causal or not, key padding, segment ids): "
        "MaxText's default")
    assert c("auto", "tpu", bias="T5 relative positions") == (
        "pallas", "an additive bias (T5 relative positions)")
    assert c("auto", "tpu", mask="general")[0] == "pallas"
    assert c("auto", "tpu", pattern=strided) == ("pallas", "the 'strided' sparse pattern")
    assert resolve_implementation("auto", "tpu", tpu_generation=3) == "xla"
    assert resolve_implementation("auto", "cpu") == "xla"
    assert resolve_implementation("splash", "cpu", mask="keys") == "splash"   # interpret mode
    with pytest.raises(UserError, match=r"cannot express an additive bias \(T5 relative "
                                        r"positions\).*'auto' or 'pallas'"):
        resolve_implementation("splash", "tpu", bias="T5 relative positions")
    with pytest.raises(UserError, match="cannot express a mask with a head or query axis"):
        resolve_implementation("splash", "cpu", mask="general")
    with pytest.raises(UserError, match="cannot run on a TPU v3: Mosaic"):
        resolve_implementation("splash", "tpu", tpu_generation=3)
    with pytest.raises(UserError, match="JAX's TPU kernel.*'pallas', 'cudnn'"):
        resolve_implementation("splash", "gpu")
    with pytest.raises(UserError, match="cannot express an additive bias"):
        q, k, v = _inputs(b=1, n=2, kv=2)
        dot_product_attention(q, k, v, bias=jnp.zeros((1, 2, 128, 128)), attention_impl="splash")


def test_blocks_per_generation_and_their_fit():
    """Device kinds name their table rows; blocks shrink to short lengths and halve until
    they divide the 128-rounded length."""
    kinds = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
             "TPU v6 lite": "v6e", "TPU7x": "later", "cpu": "later"}
    assert {kind: tpu_name(kind) for kind in kinds} == kinds
    assert set(SPLASH_BLOCKS) == {"v4", "v5e", "v5p", "v6e", "later"}
    assert [_fit(512, n) for n in (77, 197, 640, 1024, 8192)] == [
        (128, 128), (256, 256), (128, 640), (512, 1024), (512, 8192)]


# -------------------------------------------------------------- the real TPU compiler

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu]'")
def test_splash_compiles_for_every_generation_and_head_dim():
    """bf16 causal forward + backward at 256 tokens (4 query heads on 2 kv heads, segment
    ids) compiled by Mosaic and XLA:TPU for v4, v5e, v5p and v6e, head dims 64, 128, 256 and
    128 in turn: the forward, dQ and dK/dV kernels. Every generation at every head dim and
    at lengths up to 8192: ``benchmarks/splash_compile.py`` (docs/tpu.md)."""
    from transformer_jax.tpu import TpuSlice
    ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def loss(q, k, v, ids):
        out = dot_product_attention(q, k, v, causal=True, segment_ids=ids)
        return jnp.sum(out.astype(jnp.float32))
    for tpu, h in (("v4-8", 64), ("v5e-1", 128), ("v5p-8", 256), ("v6e-1", 128)):
        q = jax.ShapeDtypeStruct((1, 256, 4, h), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 256, 2, h), jnp.bfloat16)
        mesh = jax.make_mesh((1,), ("x",), devices=TpuSlice.parse(tpu).jax_devices()[:1])
        with jax.set_mesh(mesh):
            lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, ids).lower(
                lowering_platforms=("tpu",))
            lowered.compile()
        kernels = re.findall(r'kernel_name = "(splash_\w+)"', lowered.as_text())
        want = ["splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
                "splash_mha_dkv_segmented_no_residuals"]
        assert sorted(kernels) == sorted(want), (tpu, kernels)
