"""Sliding-window and strided/fixed sparse attention (``masks.AttentionPattern``): the masks
against hand-written goldens, block skipping in the chunked and Pallas paths equal to the
reference with the same mask (forward and gradients), the ring cache of window decoding
and linear attention's recurrent state equal to the full pass, and the model options.

fp32 parity within ``TOL`` (1e-5) under ``jax_default_matmul_precision="highest"``.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers import MultiHeadAttention, dot_product_attention
from transformer_jax.layers.flash_attention import BlockSizes, flash_attention
from transformer_jax.layers.masks import (AttentionPattern, fixed_mask, sliding_window_mask,
                                          strided_mask)

TOL = 1e-5


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _rows(mask):
    return ["".join("1" if x else "." for x in row) for row in np.asarray(mask[0, 0])]


def test_pattern_masks_golden():
    """Child et al.'s patterns for T = 8, stride 3 (fixed: 1 summary column)."""
    assert _rows(strided_mask(8, stride=3)) == [
        "1.......", "11......", "111.....", "1111....", ".1111...", "..1111..", "1..1111.",
        ".1..1111"]
    assert _rows(fixed_mask(8, stride=3, summary=1)) == [
        "1.......", "11......", "111.....", "..11....", "..111...", "..1111..", "..1..11.",
        "..1..111"]
    assert _rows(strided_mask(5, stride=2, causal=False)) == [
        "111.1", "1111.", "11111", ".1111", "1.111"]
    assert _rows(fixed_mask(6, stride=3, summary=1, causal=False)) == [
        "111..1", "111..1", "111..1", "..1111", "..1111", "..1111"]
    np.testing.assert_array_equal(
        AttentionPattern("window", 3).mask(6, causal=True), sliding_window_mask(6, window=3))


def test_pattern_parse_and_errors():
    assert AttentionPattern.parse("strided:128") == AttentionPattern("strided", 128)
    assert AttentionPattern.parse("fixed:128:16") == AttentionPattern("fixed", 128, 16)
    with pytest.raises(UserError, match=r"'strided:x' is not understood; write 'strided:STRIDE'"):
        AttentionPattern.parse("strided:x")
    with pytest.raises(UserError, match=r"unknown attention pattern 'dilated'"):
        AttentionPattern("dilated", 4)
    with pytest.raises(UserError, match=r"summary must be an integer in \[1, stride=4\]"):
        AttentionPattern("fixed", 4, 5)


@pytest.mark.parametrize("pattern", [AttentionPattern("window", 5), AttentionPattern("strided", 4),
                                     AttentionPattern("fixed", 6, 2)])
def test_block_ranges_and_dead_tiles_never_drop_an_allowed_pair(pattern):
    """Exhaustively over 30 x 30 positions and tile sizes 3..8: every allowed pair lies in
    a key block of its query block's range, in a query block of its key block's range, and
    in a tile the pattern calls live."""
    from transformer_jax.layers.attention_base import key_block_range, query_block_range
    n = 30
    for causal in (True, False):
        allowed = np.asarray(pattern.mask(n, causal=causal)[0, 0])
        for qc, kc in itertools.product((3, 8), (4, 5)):
            nq, nk = -(-n // qc), -(-n // kc)
            for i, j in zip(*np.nonzero(allowed)):
                qi, ki = i // qc, j // kc
                lo, hi = key_block_range(pattern, causal, qi * qc, qc, kc, nk)
                assert int(lo) <= ki < int(hi), (i, j)
                lo, hi = query_block_range(pattern, causal, ki * kc, kc, qc, nq)
                assert int(lo) <= qi < int(hi), (i, j)
                tile = (qi * qc, qi * qc + qc, ki * kc, ki * kc + kc)
                assert bool(pattern.tile_live(*tile, causal)), (i, j)


def _inputs(t=50, n=4, k=2, h=8):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, t, n, h))
    kv = [jax.random.normal(x, (2, t, k, h)) for x in keys[1:3]]
    ct = jax.random.normal(keys[3], (2, t, n, h))
    mask = (jnp.arange(t)[None] >= jnp.array([0, 19])[:, None])[:, None, None, :]  # left pad
    return (q, *kv), ct, mask


def _value_and_grads(fn, args, ct):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2)))(*args)


CASES = [  # (pattern, causal, masked, path)
    (AttentionPattern("window", 9), True, True, "chunked"),
    (AttentionPattern("window", 9), False, False, "chunked"),
    (AttentionPattern("strided", 6), True, False, "chunked"),
    (AttentionPattern("fixed", 16, 3), True, True, "chunked"),
    (AttentionPattern("window", 20), True, True, "pallas"),
    (AttentionPattern("strided", 6), False, True, "pallas"),
    (AttentionPattern("fixed", 16, 3), True, False, "pallas"),
]


@pytest.mark.parametrize("pattern,causal,masked,path", CASES)
def test_block_skipping_equals_the_reference_with_the_same_mask(pattern, causal, masked, path):
    """The chunked and Pallas (interpret) paths skip the blocks outside the pattern; their
    outputs and gradients equal the reference given the pattern as a plain mask (padded
    rows whose window holds no real key included: they get the mean of V, as there)."""
    args, ct, mask = _inputs()
    mask = mask if masked else None
    t = args[0].shape[1]
    explicit = jnp.broadcast_to(pattern.mask(t, causal=causal), (2, 1, t, t))
    if mask is not None:
        explicit = explicit & mask

    def reference(q, k, v):
        return dot_product_attention(q, k, v, mask=explicit, attention_impl="xla")

    def blocks(q, k, v):
        if path == "pallas":
            return flash_attention(q, k, v, mask=mask, causal=causal, pattern=pattern,
                                   block_sizes=BlockSizes(16, 16))
        return dot_product_attention(q, k, v, mask=mask, causal=causal, pattern=pattern,
                                     attention_impl="chunked", q_chunk=16, kv_chunk=16)

    (want, want_g), (got, got_g) = (_value_and_grads(f, args, ct) for f in (reference, blocks))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)           # sum(out * ct)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
    out = dot_product_attention(*args, mask=mask, causal=causal, pattern=pattern,
                                attention_impl="xla")
    np.testing.assert_allclose(out, reference(*args), rtol=TOL, atol=TOL)


def test_window_visits_o_t_w_tiles_and_its_memory_grows_linearly():
    """The key blocks a causal window of W = 256 visits, in blocks of 64: (W / 64 + 1) per
    query block, so the tiles grow linearly with T (full causal attention: T^2 / 2). The
    compiled temporaries of its forward + backward at most double (x 2.2) from T = 1,024
    to 2,048 (the reference's grow x 4: benchmarks/attention.py --long)."""
    from transformer_jax.layers.attention_base import key_block_range
    from transformer_jax.layers.chunked_attention import default_chunk
    window = AttentionPattern("window", 256)
    assert [default_chunk(p) for p in (None, window, AttentionPattern("window", 4096),
                                       AttentionPattern("window", 8),
                                       AttentionPattern("strided", 64))] == [512, 64, 512, 64, 512]

    def tiles(t, pattern):
        n = t // 64
        return sum(int(hi) - int(lo) for lo, hi in
                   (key_block_range(pattern, True, i * 64, 64, 64, n) for i in range(n)))

    assert [tiles(t, window) for t in (1024, 2048, 4096)] == [70, 150, 310]   # 5 per block, fewer at the start
    assert [tiles(t, None) for t in (1024, 2048, 4096)] == [136, 528, 2080]

    def temp(t, pattern, attention_impl):
        q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)

        def loss(q, k, v):
            return jnp.sum(dot_product_attention(q, k, v, causal=True, pattern=pattern,
                                                 attention_impl=attention_impl, q_chunk=64,
                                                 kv_chunk=64))
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, q, q).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(2048, window, "chunked") / temp(1024, window, "chunked") < 2.2


def _decode(module, params, x, mask, prefill):
    """Prefill ``prefill`` positions, then one per (jitted) call."""
    cache = module.init(jax.random.PRNGKey(1), x, causal=True, decode=True)["cache"]
    cache = jax.tree.map(jnp.zeros_like, cache)

    @jax.jit
    def step(cache, x):
        y, state = module.apply({"params": params, "cache": cache}, x, mask=mask, causal=True,
                                decode=True, mutable=["cache"])
        return y, state["cache"]

    outs = []
    for a, e in [(0, prefill)] + [(i, i + 1) for i in range(prefill, x.shape[1])]:
        y, cache = step(cache, x[:, a:e])
        outs.append(y)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("kind", ["window", "strided", "linear"])
def test_decoding_equals_the_full_pass(kind):
    """Prefill 9 tokens (more than the window of 5), then one token per call, rotary
    positions, GQA, a left-padded row: the outputs at the real positions equal the full
    causal pass. A window's cache is a ring of W slots whatever the sequence length;
    linear attention's is its (B, K, H, Hv) state."""
    b, t, d = 2, 23, 32
    x = jax.random.normal(jax.random.PRNGKey(0), (b, t, d))
    valid = jnp.arange(t)[None] >= jnp.array([0, 4])[:, None]
    pattern = {"window": AttentionPattern("window", 5), "strided": AttentionPattern("strided", 4),
               "linear": None}[kind]
    module = MultiHeadAttention(num_heads=4, num_kv_heads=2, pattern=pattern, rope_base=1e4,
                                attention="linear" if kind == "linear" else "softmax")
    params = module.init(jax.random.PRNGKey(1), x, causal=True)["params"]
    mask = valid[:, None, None, :]
    full = module.apply({"params": params}, x, mask=mask, causal=True)
    decoded, cache = _decode(module, params, x, mask, prefill=9)
    np.testing.assert_allclose(decoded[valid], full[valid], rtol=TOL, atol=TOL)
    shapes = {name: value.shape for name, value in cache.items()}
    if kind == "window":
        assert shapes["cached_key"] == shapes["cached_value"] == (b, 2, 5, 8)
        longer = module.init(jax.random.PRNGKey(1), jnp.zeros((b, 4 * t, d)), causal=True,
                             decode=True)["cache"]
        assert longer["cached_key"].shape == (b, 2, 5, 8)
    elif kind == "linear":
        assert shapes["linear_state"] == (b, 2, 8, 8) and shapes["linear_norm"] == (b, 2, 8)
        assert "cached_key" not in shapes
    else:
        assert shapes["cached_key"] == (b, 2, t, 8)


def test_linear_attention_refuses_what_it_cannot_do():
    args, _, _ = _inputs(t=8)
    with pytest.raises(UserError, match=r"linear attention\) has no a bias"):
        dot_product_attention(*args, bias=jnp.zeros((1, 1, 8, 8)), attention="linear")
    with pytest.raises(UserError, match=r"has no a window/sparse pattern"):
        dot_product_attention(*args, pattern=AttentionPattern("window", 2), attention="linear")
