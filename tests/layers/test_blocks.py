"""Encoder and decoder blocks equal their sublayers composed by hand."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import (DecoderBlock, EncoderBlock, FeedForward, LayerNorm,
                                    MultiHeadAttention, padding_mask_from_lengths)

from ..helpers import FP32_TOL, rand


@pytest.mark.parametrize("pre_norm", [True, False])
def test_encoder_block_composition(pre_norm):
    """The block equals its sublayers composed by hand (pre: x + f(norm x); post: norm(x + f(x)))."""
    x = rand(0, (2, 5, 16))
    mask = padding_mask_from_lengths(jnp.array([5, 3]), 5)
    blk = EncoderBlock(num_heads=4, mlp_dim=32, pre_norm=pre_norm)
    p = nn.meta.unbox(blk.init(jax.random.PRNGKey(1), x))["params"]
    mha, ff, ln = MultiHeadAttention(num_heads=4), FeedForward(mlp_dim=32), LayerNorm()
    attn = lambda h: mha.apply({"params": p["self_attn"]}, h, mask=mask)
    mlp = lambda h: ff.apply({"params": p["mlp"]}, h)
    n1 = lambda h: ln.apply({"params": p["norm1"]}, h)
    n2 = lambda h: ln.apply({"params": p["norm2"]}, h)
    if pre_norm:
        h = x + attn(n1(x))
        expected = h + mlp(n2(h))
    else:
        h = n1(x + attn(x))
        expected = n2(h + mlp(h))
    np.testing.assert_allclose(blk.apply({"params": p}, x, mask), expected, **FP32_TOL)


def test_decoder_block_cross_attention_uses_memory():
    x, mem = rand(0, (2, 4, 16)), rand(1, (2, 6, 16))
    blk = DecoderBlock(num_heads=4, mlp_dim=32, pre_norm=False)
    p = nn.meta.unbox(blk.init(jax.random.PRNGKey(1), x, mem))["params"]
    assert set(p) == {"self_attn", "cross_attn", "mlp", "norm1", "norm2", "norm3"}
    y1 = blk.apply({"params": p}, x, mem)
    y2 = blk.apply({"params": p}, x, mem.at[:, -1].set(0.0))
    masked = blk.apply({"params": p}, x, mem.at[:, -1].set(0.0),
                       cross_mask=padding_mask_from_lengths(jnp.array([5, 5]), 6))
    masked_ref = blk.apply({"params": p}, x, mem, cross_mask=padding_mask_from_lengths(jnp.array([5, 5]), 6))
    assert float(jnp.abs(y1 - y2).max()) > 1e-3
    np.testing.assert_allclose(masked, masked_ref, **FP32_TOL)   # masked memory slots are ignored
    # causality: changing a later target token does not change earlier outputs
    y3 = blk.apply({"params": p}, x.at[:, -1].set(5.0), mem)
    np.testing.assert_allclose(y3[:, :-1], y1[:, :-1], **FP32_TOL)
    with pytest.raises(ValueError, match="memory"):
        blk.apply({"params": p}, x)
