"""Block sizes of the Pallas flash kernel per TPU generation (``flash_blocks.py``): the
table, and against the TPU compiler (libtpu on this CPU host) at one of its entries: the
chosen blocks compile forward and backward with a T5-style bias and segment ids, twice
those blocks run out of VMEM."""
import importlib.util

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.layers.flash_attention import flash_attention
from transformer_jax.layers.flash_blocks import (DEFAULT_BLOCK_SIZES, BlockSizes,
                                                 tpu_block_sizes, tpu_chip)


def test_tpu_block_sizes_table():
    """Square blocks: up to 512 without a bias; with a (1, N, T, S) fp32 bias
    the (block, S) rows double-buffered within 4 MiB (v4), 16 MiB (v5p), 32 MiB (v5e,
    v6e); never under 128; 128 where the generation is unknown."""
    def block(generation, length, bias):
        sizes = tpu_block_sizes(generation, 64, length, length, bias)
        assert sizes.block_q == sizes.block_k and sizes.bwd == (sizes.block_q,) * 2
        return sizes.block_q

    lengths = (512, 1024, 2048, 4096, 8192)
    assert [block("v4", t, True) for t in lengths] == [512, 512, 256, 128, 128]
    assert [block("v5p", t, True) for t in lengths] == [512, 512, 512, 512, 256]
    for generation in ("v4", "v5e", "v5p", "v6e"):
        assert block(generation, 8192, False) == 512
    for generation in ("v5e", "v6e"):
        assert [block(generation, t, True) for t in lengths] == [512] * 5
    assert tpu_block_sizes(None, 64, 8192, 8192, True) == DEFAULT_BLOCK_SIZES["tpu"]
    assert tpu_block_sizes("v3", 64, 512, 512, False) == BlockSizes(128, 128)


def _compile(generation_slice, t, block_sizes):
    """Forward + backward (Q, K, V and the bias) of the kernel for one chip of the slice,
    bf16, causal, 4 heads of 64, a (1, 4, T, T) fp32 bias, two packed documents."""
    from transformer_jax.tpu import TpuSlice
    devices = TpuSlice.parse(generation_slice).jax_devices()[:1]
    mesh = jax.make_mesh((1,), ("x",), devices=devices)
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16, sharding=one)
    bias = jax.ShapeDtypeStruct((1, 4, t, t), jnp.float32, sharding=one)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=one)

    def loss(q, k, v, bias, ids):
        out = flash_attention(q, k, v, bias=bias, causal=True, platform="tpu",
                              block_sizes=block_sizes, segment_ids=(ids, ids))
        return jnp.sum(out.astype(jnp.float32))
    with jax.set_mesh(mesh):
        chip = tpu_chip()
        jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(q, q, q, bias, ids).lower().compile()
    return chip


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu]'")
def test_v4_blocks_are_the_largest_that_compile_with_a_bias():
    """v4 (16 MiB of VMEM) at T = 2,048 with a bias: the default (the table's 256) compiles,
    with segment ids as well; 512 x 512 runs out of VMEM."""
    assert tpu_block_sizes("v4", 64, 2048, 2048, True) == BlockSizes(256, 256)
    assert _compile("v4-8", 2048, None) == "v4"          # the default: the table's entry
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED.*vmem"):
        _compile("v4-8", 2048, BlockSizes(512, 512))
