"""layer_stack: unrolled, scanned and rematerialised stacks compute the same function, and
the layout helpers move parameter trees between them exactly."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers import DecoderBlock, EncoderBlock, padding_mask_from_lengths
from transformer_jax.layers.stack import convert_layout, layer_stack, stack_layers, unstack_layers

from ..helpers import FP32_TOL, rand

FIELDS = dict(num_heads=2, mlp_dim=32, pre_norm=True)


class Encoder(nn.Module):
    scan: bool = False
    remat: bool = False
    policy: str = "nothing_saveable"

    @nn.compact
    def __call__(self, x, mask):
        return layer_stack(EncoderBlock, FIELDS, 3, x, name="layers", operands={"mask": mask},
                           static={"deterministic": True}, scan=self.scan, remat=self.remat,
                           remat_policy=self.policy)


class Decoder(nn.Module):
    scan: bool = False

    @nn.compact
    def __call__(self, x, memory, decode=False):
        return layer_stack(DecoderBlock, FIELDS, 2, x, name="layers",
                           operands={"memory": memory},
                           static={"causal": True, "decode": decode}, scan=self.scan)


def _inputs():
    return rand(0, (2, 5, 16)), padding_mask_from_lengths(jnp.array([5, 3]), 5)


def test_scanned_stack_equals_unrolled_forward_and_gradient():
    x, mask = _inputs()
    plain = nn.meta.unbox(Encoder().init(jax.random.PRNGKey(1), x, mask))["params"]
    assert sorted(plain) == ["layers_0", "layers_1", "layers_2"]
    stacked = stack_layers(plain, 3, name="layers")
    assert stacked["layers"]["self_attn"]["query"]["kernel"].shape == (3, 16, 2, 8)
    want = Encoder().apply({"params": plain}, x, mask)
    got = Encoder(scan=True).apply({"params": stacked}, x, mask)
    np.testing.assert_allclose(got, want, **FP32_TOL)

    def loss(module, p):
        return jnp.sum(jnp.sin(module.apply({"params": p}, x, mask)))
    g_plain = jax.grad(lambda p: loss(Encoder(), p))(plain)
    g_scan = unstack_layers(jax.grad(lambda p: loss(Encoder(scan=True), p))(stacked), name="layers")
    for a, b in zip(jax.tree_util.tree_leaves(g_scan), jax.tree_util.tree_leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # scanned init has the same tree (with the leading axis) as the stacked unrolled init
    scanned_init = nn.meta.unbox(Encoder(scan=True).init(jax.random.PRNGKey(1), x, mask))["params"]
    assert jax.tree_util.tree_structure(scanned_init) == jax.tree_util.tree_structure(stacked)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable",
                                    "dots_with_no_batch_dims_saveable", "everything_saveable"])
@pytest.mark.parametrize("scan", [False, True])
def test_remat_changes_no_gradient(policy, scan):
    x, mask = _inputs()
    params = nn.meta.unbox(Encoder(scan=scan).init(jax.random.PRNGKey(1), x, mask))["params"]

    def grad(module):
        return jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x, mask) ** 2)))(params)
    # fp32 sums in another order: each leaf within 1e-5 of its largest entry (on Zen 3's AVX2
    # kernels an entry of ~0.02 in a leaf whose largest entry is ~30 moved by 1.25e-5)
    for a, b in zip(jax.tree_util.tree_leaves(grad(Encoder(scan=scan, remat=True, policy=policy))),
                    jax.tree_util.tree_leaves(grad(Encoder(scan=scan)))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_scanned_decoder_keeps_a_stacked_cache():
    """Decoding through a scanned stack: the self- and cross-attention caches carry the
    leading layer axis, and step-by-step outputs equal the full causal pass."""
    x, memory = rand(0, (2, 4, 16)), rand(1, (2, 6, 16))
    params = nn.meta.unbox(Decoder(scan=True).init(jax.random.PRNGKey(2), x, memory))["params"]
    full = Decoder(scan=True).apply({"params": params}, x, memory)
    _, state = Decoder(scan=True).apply({"params": params}, x, memory, decode=True,
                                        mutable=["cache"])         # creates the cache
    cache = state["cache"]
    assert cache["layers"]["self_attn"]["cached_key"].shape == (2, 2, 2, 4, 8)   # (L, B, K, S, H)
    outs = []
    for i in range(4):
        y, state = Decoder(scan=True).apply({"params": params, "cache": cache}, x[:, i:i + 1],
                                            memory, decode=True, mutable=["cache"])
        cache = state["cache"]
        outs.append(y)
    assert cache["layers"]["cross_attn"]["cached_key"].shape == (2, 2, 2, 6, 8)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **FP32_TOL)


def test_convert_layout_round_trips_nested_stacks():
    tree = {"encoder": {"layers_0": {"w": np.ones(2)}, "layers_1": {"w": 2 * np.ones(2)},
                        "norm": {"scale": np.zeros(2)}},
            "decoder": {"layers_0": {"w": 3 * np.ones(2)}}, "embed": np.arange(3)}
    stacks = ((("encoder",), "layers", 2), (("decoder",), "layers", 1))
    scanned = convert_layout(tree, stacks, scanned=True)
    np.testing.assert_array_equal(scanned["encoder"]["layers"]["w"], [[1, 1], [2, 2]])
    assert sorted(scanned["encoder"]) == ["layers", "norm"]
    assert scanned["decoder"]["layers"]["w"].shape == (1, 2)
    again = convert_layout(scanned, stacks, scanned=True)                # already scanned
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(again),
                                      jax.tree_util.tree_leaves(scanned)))
    back = convert_layout(scanned, stacks, scanned=False)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)):
        np.testing.assert_array_equal(a, b)
    assert tree["encoder"]["layers_0"]["w"][0] == 1                       # input untouched


def test_errors_name_the_problem():
    x, mask = _inputs()
    with pytest.raises(ValueError, match="unknown remat_policy 'dots'"):
        Encoder(remat=True, policy="dots").init(jax.random.PRNGKey(0), x, mask)
    with pytest.raises(KeyError, match=r"missing \['layers_2'\]"):
        stack_layers({"layers_0": {}, "layers_1": {}}, 3, name="layers")
    with pytest.raises(KeyError, match="no 'layers' subtree"):
        unstack_layers({"layers_0": {}}, name="layers")


class PerLayer(nn.Module):
    """Three encoder layers, the middle one post-norm (``per_layer`` fields)."""
    scan: bool = False

    @nn.compact
    def __call__(self, x, mask):
        return layer_stack(EncoderBlock, FIELDS, 3, x, name="layers", operands={"mask": mask},
                           static={"deterministic": True}, scan=self.scan,
                           per_layer=[{}, {"pre_norm": False}, {}])


def test_per_layer_fields_apply_to_their_layer_only():
    """Layer by layer, ``per_layer`` equals blocks built with those fields by hand; a scan
    (one repeated layer) refuses per-layer fields by name."""
    x, mask = _inputs()
    variables = PerLayer().init(jax.random.PRNGKey(0), x, mask)
    params = variables["params"]
    y = x
    for i, pre in enumerate((True, False, True)):
        y = EncoderBlock(**{**FIELDS, "pre_norm": pre}).apply(
            {"params": params[f"layers_{i}"]}, y, mask)
    np.testing.assert_allclose(PerLayer().apply(variables, x, mask), y, **FP32_TOL)
    uniform = Encoder().apply(variables, x, mask)
    assert np.abs(np.asarray(uniform) - np.asarray(y)).max() > 1e-3
    with pytest.raises(UserError, match="per_layer needs unrolled layers"):
        PerLayer(scan=True).init(jax.random.PRNGKey(0), x, mask)
