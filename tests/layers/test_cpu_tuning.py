"""The XLA:CPU tuning seam: identities to every derivative order, present in what the CPU
compiles, absent from what TPU and CUDA would run, and off with ``cpu_tuning=False``."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import EncoderBlock, dot_product_attention
from transformer_jax.layers import cpu_tuning, dense

from ..helpers import attention_inputs, lowered_text, rand

ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the compiled HLO is XLA:CPU's")


# ----------------------------------------------------------------------------- identities

def test_residual_is_the_identity_to_every_order():
    """Values, gradients, tangents and second derivatives through ``residual`` equal those
    of the plain function bitwise, also under vmap, with NaN inputs, for an empty array and
    for integer inputs (float0 tangents)."""
    sgo = cpu_tuning.residual
    x, dx = rand(1, (3, 4, 8)), rand(2, (3, 4, 8))
    f = lambda a: jnp.sum(jnp.sin(sgo(a) * 1.5) ** 2)      # noqa: E731
    ref = lambda a: jnp.sum(jnp.sin(a * 1.5) ** 2)         # noqa: E731
    np.testing.assert_array_equal(sgo(x), x)
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(x), jax.jit(jax.grad(ref))(x))
    np.testing.assert_array_equal(jax.jvp(f, (x,), (dx,))[1], jax.jvp(ref, (x,), (dx,))[1])
    hv = jax.jvp(jax.grad(f), (x,), (dx,))[1]
    np.testing.assert_array_equal(hv, jax.jvp(jax.grad(ref), (x,), (dx,))[1])
    np.testing.assert_array_equal(jax.vmap(jax.grad(f))(x), jax.vmap(jax.grad(ref))(x))
    xn = x.at[0, 0, 0].set(jnp.nan)
    np.testing.assert_array_equal(jax.grad(f)(xn), jax.grad(ref)(xn))
    assert jax.grad(lambda a: jnp.sum(sgo(a)))(jnp.zeros((0, 3))).shape == (0, 3)
    ints = jnp.arange(6)
    primal, tangent = jax.jvp(sgo, (ints,), (np.zeros(6, jax.dtypes.float0),))
    np.testing.assert_array_equal(primal, ints)
    assert tangent.dtype == jax.dtypes.float0


def test_matmul_weight_is_the_identity_to_every_order():
    """Values, gradients, tangents and second derivatives through ``matmul_weight`` equal
    those of the plain matmul (fp32, highest precision), for tall and wide operands."""
    hi = jax.lax.Precision.HIGHEST
    for k, n in [(24, 8), (8, 24), (12, 12)]:
        x, w, g = rand(0, (32, k)), rand(1, (k, n)), rand(2, (32, n))
        dw = rand(3, (k, n))

        def f(a, b, through=cpu_tuning.matmul_weight):
            return jnp.vdot(jnp.tanh(jnp.dot(a, through(b), precision=hi)), g)
        ref = functools.partial(f, through=lambda b: b)
        np.testing.assert_array_equal(cpu_tuning.matmul_weight(w), w)
        np.testing.assert_array_equal(f(x, w), ref(x, w))
        grads = [jax.jit(jax.grad(fn, (0, 1)))(x, w) for fn in (f, ref)]
        for got, want in zip(*grads):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jax.jvp(lambda b: f(x, b), (w,), (dw,))[1],
                                   jax.jvp(lambda b: ref(x, b), (w,), (dw,))[1], rtol=1e-6)
        hvp = lambda fn: jax.jvp(jax.grad(lambda b: fn(x, b)), (w,), (dw,))[1]  # noqa: E731
        np.testing.assert_allclose(hvp(f), hvp(ref), rtol=1e-5, atol=1e-6)
    for bad in (lambda a: cpu_tuning.matmul_weight(a),
                jax.grad(lambda a: jnp.sum(cpu_tuning.matmul_weight(a)))):
        with pytest.raises(ValueError,
                           match=r"2-D matmul operand \(K, N\), got shape \(2, 3, 4\)"):
            bad(jnp.ones((2, 3, 4)))


def _plain_attention(q, k, v, mask, bias, causal):
    """softmax(Q K^T / sqrt(H) + bias) V written with plain einsums (GQA by repeating K/V)."""
    n, kv, h = q.shape[2], k.shape[2], q.shape[3]
    k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, precision=hi) / np.sqrt(h) + bias
    allowed = mask & jnp.tril(jnp.ones(logits.shape[-2:], bool)) if causal else mask
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v, precision=hi)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matmuls_derivatives_equal_the_plain_formula_to_every_order(causal):
    """The reference attention's two matmuls carry written-out JVPs. Values, gradients,
    forward-mode tangents, a second derivative and a vmapped gradient (each jitted) all
    equal those of the plain formula: GQA, bias, padding mask, causal query blocks of 16
    over T=37."""
    q, k, v, mask, bias = attention_inputs()
    ct = rand(5, q.shape)
    ours = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, bias=bias,  # noqa: E731
                                                 causal=causal, q_chunk=16,
                                                 attention_impl="xla")
    plain = lambda q, k, v: _plain_attention(q, k, v, mask, bias, causal)  # noqa: E731
    jit = jax.jit       # one compile per transformation, not one per primitive run eagerly
    np.testing.assert_allclose(jit(ours)(q, k, v), jit(plain)(q, k, v), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    grads = [jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v) for f in (ours, plain)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    tangents = (rand(6, q.shape), rand(7, k.shape), rand(8, v.shape))
    tangent = lambda f: jit(lambda *t: jax.jvp(f, (q, k, v), t)[1])(*tangents)  # noqa: E731
    np.testing.assert_allclose(tangent(ours), tangent(plain), rtol=1e-4, atol=1e-5)

    def second(f):      # d/dq of |d loss / dk|^2: reverse over reverse through both rules
        return jit(jax.grad(lambda q: jnp.sum(jax.grad(loss(f), 1)(q, k, v) ** 2)))(q)
    np.testing.assert_allclose(second(ours), second(plain), rtol=1e-3, atol=1e-4)
    vs = jnp.stack([v, 2 * v])
    batched = jit(jax.vmap(jax.grad(loss(ours), 2), in_axes=(None, None, 0)))(q, k, vs)
    np.testing.assert_allclose(batched[1], jit(jax.grad(loss(ours), 2))(q, k, 2 * v), rtol=1e-6)


# ----------------------------------------------------------------------------- what XLA:CPU compiles

def _row_contracting_batched_dots(causal, cpu_tuning):
    """Batched dots in the compiled attention gradient that contract the rows (axis 2) of
    both rank-4 operands, the form XLA:CPU gives to Eigen rather than YNNPACK."""
    q, k, v, _, _ = attention_inputs(n=4, kv=4, t=48, s=48)
    f = lambda q, k, v: jnp.sum(jnp.sin(dot_product_attention(  # noqa: E731
        q, k, v, causal=causal, q_chunk=16, attention_impl="xla", cpu_tuning=cpu_tuning)))
    text = jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v).compile().as_text()
    return len(re.findall(r"dot\([^\n]*lhs_batch_dims=\{0,1\}, lhs_contracting_dims=\{2\}, "
                          r"rhs_batch_dims=\{0,1\}, rhs_contracting_dims=\{2\}", text))


@ON_CPU
@pytest.mark.parametrize("causal", [False, True])
def test_attention_key_and_value_gradients_contract_a_transposed_operand(causal):
    """dK and dV contract over the query rows. With the plain einsums (cpu_tuning=False)
    XLA:CPU computes them as dots over the rows of both operands (2 per query block: 6
    causal with blocks of 16 over 48 rows, 2 over the whole square); tuned, none is left."""
    assert _row_contracting_batched_dots(causal, cpu_tuning=True) == 0
    assert _row_contracting_batched_dots(causal, cpu_tuning=False) == (6 if causal else 2)


class _PreNormStack(nn.Module):
    layers: int
    cpu_tuning: bool = True

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = EncoderBlock(num_heads=2, mlp_dim=48, cpu_tuning=self.cpu_tuning)(x)
        return x


def _grad_hlo_facts(layers, cpu_tuning=True):
    """(conditionals, the most operands of any activation-shaped fusion) in the compiled
    parameter gradient of a pre-norm stack, x (2, 8, 24)."""
    x = rand(0, (2, 8, 24))
    model = _PreNormStack(layers, cpu_tuning)
    params = model.init(jax.random.PRNGKey(1), x)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2)))
    text = grad.lower(params).compile().as_text()
    operands = [line.split("=", 1)[1].split("metadata")[0].count("%") - 1
                for line in text.splitlines()
                if re.match(r"\s*(ROOT )?%\w*fusion[.\d]* = f32\[(2,8,24|16,24)\]", line)]
    return text.count(" conditional("), max(operands)


@ON_CPU
def test_pre_norm_residual_gradient_is_stored_once_per_sublayer_on_cpu():
    """XLA:CPU would otherwise recompute the residual stream's gradient chain inside every
    layer's backward fusion: with ``cpu_tuning=False`` the largest fusion grows with depth.
    Tuned, one conditional per sublayer survives compilation (the very first one's
    gradient, w.r.t. the input, is not needed), and the fusions don't grow with depth."""
    conds2, ops2 = _grad_hlo_facts(2)
    conds4, ops4 = _grad_hlo_facts(4)
    assert (conds2, conds4) == (2 * 2 - 1, 2 * 4 - 1)
    assert ops4 == ops2 <= 12, (ops2, ops4)
    plain2, plain_ops2 = _grad_hlo_facts(2, cpu_tuning=False)
    plain4, plain_ops4 = _grad_hlo_facts(4, cpu_tuning=False)
    assert (plain2, plain4) == (0, 0)
    # untuned, the largest fusion grows by ~16 operands a layer (27 at 2 layers, 60 at 4)
    assert plain_ops4 > plain_ops2 > ops2, (plain_ops2, plain_ops4)
    # vmap keeps the conditional (its predicate doesn't depend on the batched values)
    grads = jax.jit(jax.vmap(jax.grad(lambda a: jnp.sum(jnp.sin(cpu_tuning.residual(a)) ** 2))))
    assert grads.lower(rand(0, (4, 3, 8))).compile().as_text().count(" conditional(") == 1


def _weight_gradient_dots(cpu_tuning):
    """Output shapes, as laid out in memory (row-major), of the dots that contract the rows
    (the weight gradients) in the compiled parameter gradient of Dense(48 -> 16) followed
    by a tied read-out (V=64)."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return dense.Embed(64, 16, cpu_tuning=cpu_tuning).attend(
                dense.Dense(16, cpu_tuning=cpu_tuning)(x))
    x = rand(0, (4, 8, 48))
    params = Net().init(jax.random.PRNGKey(1), x)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(Net().apply(p, x)))))
    text = grad.lower(params).compile().as_text()
    shapes = []
    for m in re.finditer(r"= f32\[(\d+),(\d+)\]\{(\d),(\d)\} dot\([^\n]*lhs_contracting_dims=\{0\}",
                         text):
        a, b, minor = int(m.group(1)), int(m.group(2)), m.group(3)
        shapes.append((a, b) if minor == "1" else (b, a))      # as laid out in memory
    return sorted(shapes)


@ON_CPU
def test_weight_gradients_are_computed_with_the_longer_axis_last():
    """Dense's (48, 16) kernel and the (64, 16) read-out table get their gradients as
    (16, 48) and (16, 64) products (XLA:CPU's faster orientation), transposed afterwards;
    with ``cpu_tuning=False`` XLA writes them as (48, 16) and (64, 16)."""
    assert _weight_gradient_dots(cpu_tuning=True) == [(16, 48), (16, 64)]
    assert _weight_gradient_dots(cpu_tuning=False) == [(48, 16), (64, 16)]


# ----------------------------------------------------------------------------- other platforms

def _gpt_gradient(**overrides):
    from transformer_jax.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=32, max_len=64, num_layers=2, num_heads=2, d_model=16,
                    attention_impl="xla", **overrides)
    model, ids = GPT(cfg), jnp.zeros((1, 64), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), ids)
    return jax.grad(lambda p: jnp.sum(model.apply(p, ids) ** 2)), params


def test_tuning_is_lowered_for_the_cpu_only():
    """The same jitted GPT gradient, lowered from this host: for the CPU it holds the
    residual conditionals (one per sublayer, 2 layers x 2) and the optimization barriers
    of the weight-gradient and attention tunings; for TPU and CUDA neither. With
    ``cpu_tuning=False`` the CPU program has neither as well."""
    grad, params = _gpt_gradient()
    texts = {p: lowered_text(grad, (params,), p) for p in ("cpu", "cuda", "tpu")}
    assert texts["cpu"].count("stablehlo.case") == 4
    assert texts["cpu"].count("stablehlo.optimization_barrier") > 10
    for platform in ("cuda", "tpu"):
        assert "stablehlo.case" not in texts[platform], platform
        assert "optimization_barrier" not in texts[platform], platform
    plain_grad, _ = _gpt_gradient(cpu_tuning=False)
    plain = lowered_text(plain_grad, (params,), "cpu")
    assert "stablehlo.case" not in plain and "optimization_barrier" not in plain


def test_cpu_tuning_changes_no_value():
    """Loss and gradients with and without the tuning agree to fp32 rounding."""
    grad, params = _gpt_gradient()
    plain_grad, _ = _gpt_gradient(cpu_tuning=False)
    for a, b in zip(jax.tree_util.tree_leaves(jax.jit(grad)(params)),
                    jax.tree_util.tree_leaves(jax.jit(plain_grad)(params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
