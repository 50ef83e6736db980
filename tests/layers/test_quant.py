"""QLoRA-style quantized frozen kernels (layers/quant.py): the NF4 code, int8 / NF4 / double
quantization error bounds, nibble packing, the stored layout of a GPT's params (unrolled and
scanned), a model on its quantized params equal to the same model on the dequantized
kernels, and LoRA gradients through a quantized base."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers import Dense, quant
from transformer_jax.layers.lora import LoraConfig
from transformer_jax.layers.stack import stack_layers
from transformer_jax.models.gpt import GPT, GPTConfig, init_params

# bitsandbytes ``get_4bit_type('nf4')`` / the QLoRA paper's NF4 table, value for value
NF4_REFERENCE = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]

FORMATS = [("int8", False), ("nf4", False), ("nf4", True)]
TINY = dict(dropout_rate=0.0, attention_dropout_rate=0.0)

# whole trees jitted (one compilation per tree and config, where eager runs compile every op)
quantize_params = jax.jit(quant.quantize_params, static_argnums=(1,))
dequantize_params = jax.jit(quant.dequantize_params)


def kernel(key, shape, std=0.02):
    return std * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


def test_nf4_code_is_the_reference_table():
    """Derived in float64 from the exact offset (1 - 1/30 + 1 - 1/32) / 2; the reference was
    computed with float32 probabilities and the offset rounded to 0.9677083: they agree to
    within 3 float32 ulps (1.8e-7), the endpoints and 0 exactly."""
    np.testing.assert_allclose(quant.NF4, np.float32(NF4_REFERENCE), rtol=0, atol=2e-7)
    assert quant.NF4.dtype == np.float32 and quant.NF4.shape == (16,)
    assert (quant.NF4[0], quant.NF4[7], quant.NF4[15]) == (-1.0, 0.0, 1.0)
    assert np.all(np.diff(quant.NF4) > 0)
    assert quant.NF4_MAX_GAP == pytest.approx(NF4_REFERENCE[1] + 1, abs=3e-7)   # -1 .. -0.696


def test_nibbles_pack_first_value_high_and_unpack_exactly():
    assert quant.pack_nibbles(jnp.array([1, 2, 15, 0], jnp.uint8)).tolist() == [0x12, 0xF0]
    idx = jax.random.randint(jax.random.PRNGKey(0), (3, 5, 8), 0, 16).astype(jnp.uint8)
    packed = quant.pack_nibbles(idx)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 4)
    np.testing.assert_array_equal(quant.unpack_nibbles(packed), idx)
    every_byte = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(quant.pack_nibbles(quant.unpack_nibbles(every_byte)), every_byte)


@pytest.mark.parametrize("shape,in_axes", [((64, 4, 16), 1), ((4, 16, 64), 2), ((96, 40), 1)])
def test_int8_per_output_feature_round_trip(shape, in_axes):
    k = kernel(0, shape)
    stored = quant.quantize_kernel(k, "int8", in_axes=in_axes)
    q, scale = stored["kernel_q"], stored["kernel_scale"]
    assert q.dtype == jnp.int8 and q.shape == shape
    assert scale.dtype == jnp.float32 and scale.shape == (1,) * in_axes + shape[in_axes:]
    absmax = jnp.max(jnp.abs(k), axis=tuple(range(in_axes)), keepdims=True)
    np.testing.assert_array_equal(scale, absmax / 127)
    assert np.all(np.abs(q).max(axis=tuple(range(in_axes))) == 127)   # each feature's absmax
    back = quant.dequantize_kernel(stored, shape)
    np.testing.assert_array_equal(back, q.astype(jnp.float32) * scale)
    err = np.abs(np.asarray(back - k))
    assert np.all(err <= np.asarray(scale) * 0.5 * (1 + 1e-6)), err.max()


@pytest.mark.parametrize("shape", [(64, 4, 16), (128, 3, 64), (4, 16, 64), (256, 128)])
def test_nf4_values_are_codes_times_their_block_absmax(shape):
    k = kernel(1, shape)
    stored = quant.quantize_kernel(k, "nf4", 64)
    q, absmax = stored["kernel_q"], stored["kernel_absmax"]
    assert q.dtype == jnp.uint8 and q.shape == shape[:-1] + (shape[-1] // 2,)
    assert absmax.dtype == jnp.float32 and absmax.size == k.size // 64
    # the blocks are runs of 64 of the flattened kernel (bitsandbytes' layout)
    blocks = np.asarray(k).reshape(-1, 64)
    absmax = np.asarray(absmax).reshape(-1)
    np.testing.assert_array_equal(absmax, np.abs(blocks).max(axis=1))
    idx = np.asarray(quant.unpack_nibbles(q)).reshape(-1, 64)
    back = np.asarray(quant.dequantize_kernel(stored, shape)).reshape(-1, 64)
    np.testing.assert_array_equal(back, quant.NF4[idx] * absmax[:, None])      # exactly
    # the nearest code, so the error is at most half the largest gap x the block's absmax
    err = np.abs(back - blocks)
    assert np.all(err <= 0.5 * quant.NF4_MAX_GAP * absmax[:, None] * (1 + 1e-6)), err.max()
    nearest = np.abs(blocks[..., None] / absmax[:, None, None] - quant.NF4).min(-1)
    np.testing.assert_allclose(np.abs(back / absmax[:, None] - blocks / absmax[:, None]),
                               nearest, atol=1e-6)
    rel_rms = np.sqrt(np.mean(err ** 2) / np.mean(blocks ** 2))
    assert 0.03 < rel_rms < 0.15, rel_rms          # ~4 bits on a normal distribution


def test_nf4_all_zero_block_and_a_kernel_with_exact_codes():
    k = jnp.zeros((2, 64)).at[1].set(jnp.asarray(np.tile(quant.NF4, 4)) * 3.0)
    stored = quant.quantize_kernel(k, "nf4", 64)
    np.testing.assert_array_equal(stored["kernel_absmax"], [[0.0], [3.0]])
    np.testing.assert_array_equal(quant.dequantize_kernel(stored), k)


@pytest.mark.parametrize("shape", [(256, 256), (192, 128)])     # 4 runs of 256; 1.5 (padded)
def test_double_quant_moves_each_absmax_by_at_most_half_its_step(shape):
    k = kernel(2, shape)
    plain = quant.quantize_kernel(k, "nf4", 64)
    dq = quant.quantize_kernel(k, "nf4", 64, double_quant=True)
    assert set(dq) == {"kernel_q", "kernel_absmax_q", "kernel_absmax_scale", "kernel_absmax_mean"}
    np.testing.assert_array_equal(dq["kernel_q"], plain["kernel_q"])   # indices: exact absmax
    absmax = np.asarray(plain["kernel_absmax"]).reshape(-1)
    n, runs = absmax.size, -(-absmax.size // 256)
    assert dq["kernel_absmax_q"].dtype == jnp.int8 and dq["kernel_absmax_q"].size == n
    assert dq["kernel_absmax_scale"].shape == (runs,) and dq["kernel_absmax_mean"].shape == ()
    mean = absmax.mean()
    np.testing.assert_allclose(dq["kernel_absmax_mean"], mean, rtol=1e-6)
    centred = np.pad(absmax - mean, (0, runs * 256 - n)).reshape(runs, 256)
    np.testing.assert_allclose(dq["kernel_absmax_scale"], np.abs(centred).max(1) / 127, rtol=1e-6)
    # the stated bound: |absmax' - absmax| <= scale2 / 2 (+ float32 rounding)
    back = np.asarray(quant._dequantize_absmax(dq)).reshape(-1)
    step = np.repeat(np.asarray(dq["kernel_absmax_scale"]), 256)[:n]
    assert np.all(np.abs(back - absmax) <= 0.5 * step + 4e-7 * absmax), np.abs(back - absmax).max()
    assert np.abs(back - absmax).max() > 0                 # it does quantize
    idx = np.asarray(quant.unpack_nibbles(dq["kernel_q"])).reshape(-1, 64)
    kernel_back = np.asarray(quant.dequantize_kernel(dq, shape)).reshape(-1, 64)
    np.testing.assert_array_equal(kernel_back, quant.NF4[idx] * back[:, None])
    # 8 bits + a shared scale per 64 values instead of 32: the absmax bytes drop ~4x
    assert quant.param_bytes(dq)["total"] < quant.param_bytes(plain)["total"]


def test_bad_kernels_and_formats_are_user_errors():
    with pytest.raises(UserError, match="unknown quantization format 'fp4'"):
        quant.quantize_kernel(kernel(0, (64, 64)), "fp4")
    with pytest.raises(UserError, match="not a whole number of blocks of 64"):
        quant.quantize_kernel(kernel(0, (10, 6)), "nf4", 64)
    with pytest.raises(UserError, match="last axis, which is odd"):
        quant.quantize_kernel(kernel(0, (64, 3)), "nf4", 64)
    with pytest.raises(UserError, match=r"has shape \(64, 64\), expected \(64, 32\)"):
        quant.dequantize_kernel(quant.quantize_kernel(kernel(0, (64, 64)), "nf4"), (64, 32))
    with pytest.raises(UserError, match="not a stored kernel"):
        quant.dequantize_kernel({"kernel_q": jnp.zeros(2, jnp.uint8)})


def test_param_bytes_counts_by_dtype():
    tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": {"c": jnp.zeros(10, jnp.uint8)},
            "d": jax.ShapeDtypeStruct((2, 8), jnp.bfloat16)}
    assert quant.param_bytes(tree) == {"float32": 48, "uint8": 10, "bfloat16": 32, "total": 90}


# ----------------------------------------------------------------------------- models

@pytest.fixture(scope="module")
def gpt():
    """Tiny GPT, unrolled and scanned, with the same weights, and its jitted logits of
    fixed token ids (one function each, shared by the tests: one compilation per tree)."""
    out = {}
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 512)
    for scan in (False, True):
        model = GPT(GPTConfig.preset("tiny", scan_layers=scan, **TINY))
        params = (stack_layers(out[False][1], 2, name="h") if scan
                  else init_params(model, jax.random.PRNGKey(0)))
        out[scan] = (model, params, jax.jit(lambda p, model=model: model.apply({"params": p}, ids)))
    return out


def _paths(tree):
    return {"/".join(str(k.key) for k in path): (leaf.shape, leaf.dtype)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_quantize_params_layout_of_a_gpt(gpt):
    params = gpt[False][1]
    q = jax.eval_shape(quantize_params, params, LoraConfig(quantize="nf4", double_quant=True))
    before, after = _paths(params), _paths(q)
    dense = {"self_attn/query", "self_attn/key", "self_attn/value", "self_attn/out",
             "mlp/wi", "mlp/wo"}
    quantized = {p.rsplit("/", 1)[0] for p in after if p.endswith("/kernel_q")}
    assert quantized == {f"h_{i}/{d}" for i in range(2) for d in dense}
    # everything else (embeddings, norms, biases) as it was
    assert {p: v for p, v in after.items() if "/kernel" not in p} == \
        {p: v for p, v in before.items() if "/kernel" not in p}
    assert after["h_0/self_attn/query/kernel_q"] == ((64, 4, 8), jnp.uint8)
    assert after["h_0/self_attn/query/kernel_absmax_q"] == ((64, 1), jnp.int8)
    assert after["h_0/self_attn/out/kernel_q"] == ((4, 16, 32), jnp.uint8)
    assert after["h_0/mlp/wi/kernel_absmax_q"] == ((64, 4), jnp.int8)
    assert after["h_0/mlp/wi/kernel_absmax_scale"] == ((1,), jnp.float32)
    assert after["h_0/mlp/wi/kernel_absmax_mean"] == ((), jnp.float32)
    i8 = _paths(jax.eval_shape(quantize_params, params, LoraConfig(quantize="int8")))
    assert i8["h_1/self_attn/out/kernel_q"] == ((4, 16, 64), jnp.int8)
    assert i8["h_1/self_attn/out/kernel_scale"] == ((1, 1, 64), jnp.float32)    # per D
    assert i8["h_1/self_attn/key/kernel_scale"] == ((1, 4, 16), jnp.float32)    # per (N, H)
    # the inverse gives the original tree's structure back
    assert _paths(jax.eval_shape(dequantize_params, q)) == before
    assert quant.quantize_params(params, None) is params
    assert quant.quantize_params(params, LoraConfig()) is params            # quantize=None
    with pytest.raises(UserError, match="match no Dense kernel"):
        quant.quantize_params(params, LoraConfig(quantize="nf4"), targets="nothing_here")


@pytest.mark.parametrize("fmt,dq", FORMATS)
def test_scanned_params_quantize_per_layer(gpt, fmt, dq):
    """The scanned tree quantizes each layer on its own: it is the unrolled tree's stored
    form, stacked (double quant's mean and runs included: those up to the rounding of the
    mean, a sum over (L, A) in another order than over (A,))."""
    config = LoraConfig(quantize=fmt, double_quant=dq)
    unrolled = quantize_params(gpt[False][1], config)
    want = stack_layers(unrolled, 2, name="h")
    scanned = quantize_params(gpt[True][1], config)
    assert _paths(scanned) == _paths(want)
    check = (lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)) if dq else \
        np.testing.assert_array_equal
    for a, b in zip(jax.tree_util.tree_leaves(scanned), jax.tree_util.tree_leaves(want)):
        (check if a.dtype == jnp.float32 else np.testing.assert_array_equal)(a, b)
    back, back_unrolled = dequantize_params(scanned), dequantize_params(unrolled)
    check(back["h"]["mlp"]["wi"]["kernel"],
          np.stack([back_unrolled[f"h_{i}"]["mlp"]["wi"]["kernel"] for i in range(2)]))


# relative RMS error of the logits against the fp32 model's (random tiny GPT, std 0.02)
LOGIT_TOL = {"int8": 0.02, "nf4": 0.15}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("fmt,dq", FORMATS)
def test_gpt_on_quantized_params_equals_the_dequantized_kernels(gpt, scan, fmt, dq):
    _, params, apply = gpt[scan]
    stored = quantize_params(params, LoraConfig(quantize=fmt, double_quant=dq))
    got = np.asarray(apply(stored))
    np.testing.assert_array_equal(got, apply(dequantize_params(stored)))
    ref = np.asarray(apply(params))
    rel = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
    print(f"{fmt}{'+dq' if dq else ''}: relative RMS error of the logits {rel:.4f}")
    assert rel < LOGIT_TOL[fmt], rel


def test_dense_dequantizes_to_its_compute_dtype():
    k = kernel(3, (64, 4, 16), std=0.1)
    stored = quant.quantize_kernel(k, "nf4", 64)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 5, 64))
    bias = jnp.linspace(-1, 1, 64).reshape(4, 16)
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = Dense((4, 16), dtype=dtype)
        got = layer.apply({"params": {**stored, "bias": bias}}, x)
        want = layer.apply({"params": {"kernel": quant.dequantize_kernel(stored), "bias": bias}}, x)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_lora_gradients_flow_through_a_quantized_base(scan):
    cfg = GPTConfig.preset("tiny", scan_layers=scan, lora=dict(rank=4, quantize="nf4"), **TINY)
    model = GPT(cfg)
    params = init_params(model, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, cfg.vocab_size)

    def split(tree):                       # (adapters, the rest), the same nesting
        if not isinstance(tree, dict):
            return None, None
        lora, rest = {}, {}
        for k, v in tree.items():
            if k in ("lora_a", "lora_b"):
                lora[k] = v
            elif isinstance(v, dict):
                a, b = split(v)
                if a:
                    lora[k] = a
                rest[k] = b
            else:
                rest[k] = v
        return lora, rest

    def join(lora, rest):
        out = dict(rest)
        for k, v in lora.items():
            out[k] = join(v, rest[k]) if isinstance(v, dict) else v
        return out

    lora, frozen = split(params)
    # lora_b starts at zero (then lora_a's gradient is zero): give it values first
    lora = jax.tree_util.tree_map_with_path(
        lambda p, v: 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(p))), v.shape)
        if p[-1].key == "lora_b" else v, lora)
    frozen_q = quantize_params(frozen, cfg.lora)
    assert not [p for p in _paths(frozen_q) if p.endswith("/kernel")]     # all quantized

    def loss(lora, frozen):
        logits = model.apply({"params": join(lora, frozen)}, ids[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    grad = jax.jit(jax.value_and_grad(loss))
    value, grads = grad(lora, frozen_q)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == 2 * 2 * (1 if scan else 2)   # query and value, a and b (per layer)
    assert all(np.all(np.isfinite(g)) for _, g in leaves) and np.isfinite(value)
    norms = jnp.stack([jnp.linalg.norm(g.reshape((2, -1) if scan else (1, -1)), axis=-1)
                       for _, g in leaves])
    assert np.all(norms > 0), norms                    # every adapter of every layer
    # and the same as with the dequantized kernels in fp32
    value_d, grads_d = grad(lora, dequantize_params(frozen_q))
    assert value == value_d
    for g, gd in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_d)):
        np.testing.assert_array_equal(g, gd)
