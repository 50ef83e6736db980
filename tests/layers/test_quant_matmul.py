"""The NF4 matmul kernels (layers/quant_matmul.py) on the CPU, in interpret mode: each tile
is ``dequantize_kernel``'s kernel bit for bit, the product and the input gradient match
the dequantize-then-matmul reference, and the plan tiles only what Mosaic takes. (Mosaic
compiles them for a TPU in tests/test_tpu_compile.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import quant, quant_matmul as qm

K, N, M = 256, 512, 40        # 2 absmax rows per 64 packed bytes: tiles of (128, 256) below


@pytest.fixture(scope="module", params=[False, True], ids=["absmax", "double_quant"])
def stored(request):
    kernel = 0.05 * jax.random.normal(jax.random.PRNGKey(0), (K, N))
    return quant.quantize_kernel(kernel, "nf4", 64, request.param)


def _operands(stored):
    absmax = quant.block_absmax(stored)
    return stored["kernel_q"], absmax.reshape(K, N // 64).T


def _plan(m=M):
    """Smaller tiles than ``plan_for``'s, so that each grid runs several steps each way;
    the rows padded to the backward's blocks of 16."""
    return qm.Plan(rows=-(-m // 16) * 16, k=K, n2=N // 2, half_block=32, tm=8, tm_dx=16,
                   tk=128, tn=256, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_tile_is_the_dequantized_kernel_bit_for_bit(stored, dtype):
    """The even and odd columns of ``dequantize_kernel`` (fp32 products rounded once to
    the dtype), from the packed bytes and the transposed absmax: the select tree is the
    NF4 table exactly."""
    packed, absmax_t = _operands(stored)
    hi, lo = qm.dequantize_tile(packed, absmax_t, dtype)
    want = quant.dequantize_kernel(stored, None, dtype)
    assert hi.dtype == dtype
    np.testing.assert_array_equal(hi, want[:, 0::2])
    np.testing.assert_array_equal(lo, want[:, 1::2])
    np.testing.assert_array_equal(qm.nf4_values(jnp.arange(16)), quant.NF4)


def test_rows_of_the_identity_give_the_kernel_exactly(stored):
    """x = rows of the identity: every output element is one product by 1 plus zeros, so
    the kernel's y is the dequantized kernel's rows bit for bit (the columns interleaved
    back: even from the high nibbles, odd from the low)."""
    packed, absmax_t = _operands(stored)
    y = qm.nf4_matmul(jnp.eye(K)[:M], packed, absmax_t, _plan())
    np.testing.assert_array_equal(y, quant.dequantize_kernel(stored)[:M])


def test_product_and_input_gradient_match_the_reference(stored):
    """y = x W and dx = dy W^T against XLA's at HIGHEST precision: fp32 sums in another
    order, within 2e-6 relative to the largest element. M = 40 is not a multiple of the
    16 rows the backward's blocks take: padded rows, cut off."""
    packed, absmax_t = _operands(stored)
    w = quant.dequantize_kernel(stored)
    x = jax.random.normal(jax.random.PRNGKey(1), (M, K))
    dy = jax.random.normal(jax.random.PRNGKey(2), (M, N))
    y, vjp = jax.vjp(lambda x: qm.nf4_matmul(x, packed, absmax_t, _plan()), x)
    ref = jnp.dot(x, w, precision="highest")
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(ref))))
    dx_ref = jnp.dot(dy, w.T, precision="highest")
    np.testing.assert_allclose(vjp(dy)[0], dx_ref, rtol=0,
                               atol=2e-6 * float(jnp.max(jnp.abs(dx_ref))))


def test_the_frozen_base_gets_no_gradient(stored):
    """The codes' cotangent is float0 and the absmax's zero: nothing flows into the base."""
    packed, absmax_t = _operands(stored)
    x = jnp.ones((8, K))
    _, vjp = jax.vjp(lambda x, p, a: qm.nf4_matmul(x, p, a, _plan(8)), x, packed, absmax_t)
    _, d_packed, d_absmax = vjp(jnp.ones((8, N)))
    assert d_packed.dtype == jax.dtypes.float0 and d_packed.shape == packed.shape
    assert not np.any(d_absmax)


def test_the_plan_tiles_what_mosaic_takes():
    """Llama 3 8B's projections at 1,024 rows on a chip with 96 MiB for the kernels: all
    rows in VMEM but where 16 MiB cannot hold them (the MLP's 14,336 inputs, dy's 14,336
    columns: 512 rows); rows padded to a multiple of 8; no plan for an unaligned width or
    a block of fewer than 16 values."""
    big = 96 << 20
    wi = qm.plan_for(1024, 4096, 14336, 64, 2, vmem_limit=big)
    assert (wi.tm, wi.tm_dx, wi.tk, wi.tn, wi.absmax_rows) == (1024, 512, 512, 512, 16)
    wo = qm.plan_for(1024, 14336, 4096, 64, 2, vmem_limit=big)
    assert (wo.tm, wo.tm_dx, wo.tk, wo.tn) == (512, 1024, 512, 512)
    kv = qm.plan_for(1020, 4096, 1024, 64, 2)   # the compiler's default VMEM: 4 MiB; padded
    assert (kv.rows, kv.tm, kv.tm_dx, kv.tn) == (1024, 512, 1024, 512)
    assert qm.plan_for(8, 4096, 192, 64, 2) is None      # 96 packed bytes a row
    assert qm.plan_for(8, 4096, 1024, 8, 2) is None      # 4 bytes a block
    assert qm.plan_for(8, 100, 1024, 64, 2) is None      # 100 inputs
