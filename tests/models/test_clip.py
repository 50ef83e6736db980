"""CLIP: presets and counts, pooling, the logit scale, the two towers' entry points, scan,
remat, bf16, LoRA, and a ViT with the new defaults unchanged."""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers.lora import LoraConfig
from transformer_jax.models import FAMILIES, build_model, checked
from transformer_jax.models.base import to_config_layout
from transformer_jax.models.clip import (CLIP, MAX_LOGIT_SCALE, CLIPConfig, init_params,
                                         l2_normalize, pooled_positions, resize_params)
from transformer_jax.models.vit import ViT, ViTConfig

TINY = CLIPConfig.preset("tiny")       # eos 1, pad 0, vocab 512, max_len 32, 16 px images


def random_params(cfg: CLIPConfig, seed=0, scale=0.1):
    """Random params in the model's shapes (no compiled init): ``scale * N(0, 1)``, around 1
    for norm scales and around the initial value for ``logit_scale``."""
    shapes = jax.eval_shape(lambda: init_params(CLIP(cfg), jax.random.PRNGKey(0)))
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        centre = {"scale": 1.0, "logit_scale": cfg.logit_scale_init}.get(path[-1].key, 0.0)
        return jnp.asarray(centre + scale * rng.standard_normal(x.shape), jnp.float32)
    return jax.tree_util.tree_map_with_path(leaf, shapes)


@functools.lru_cache(maxsize=None)
def apply_fn(cfg: CLIPConfig, method: str = "__call__"):
    """A jitted ``CLIP(cfg).apply`` for ``method`` (one compile per config and method)."""
    model = CLIP(cfg)
    return jax.jit(lambda p, *args: model.apply({"params": p}, *args, method=method))


def captions(seed=0, batch=3, length=10, eos=1, vocab=512):
    """(B, T) ids in [2, vocab) with one eos per row at a different place, and the mask
    (1 up to and including the eos, 0 after: right padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (batch, length)).astype(np.int32)
    ends = [length - 1 - 2 * i for i in range(batch)]
    mask = np.zeros((batch, length), np.int32)
    for row, end in enumerate(ends):
        ids[row, end] = eos
        ids[row, end + 1:] = 0
        mask[row, :end + 1] = 1
    return ids, mask


def images(seed=0, batch=2, cfg=TINY):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed),
                                        (batch, cfg.image_size, cfg.image_size, cfg.num_channels)))


@pytest.fixture(scope="module")
def params():
    return random_params(TINY)


def param_count(cfg: CLIPConfig) -> int:
    cfg = cfg.replace(scan_layers=True)             # the same count, a quicker trace
    shapes = jax.eval_shape(lambda: init_params(CLIP(cfg), jax.random.PRNGKey(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


# ----------------------------------------------------------------------------- config

def test_presets_family_and_counts():
    assert FAMILIES["clip"] == (CLIPConfig, CLIP)
    assert build_model("clip", "tiny", {"projection_dim": 16})[0].projection_dim == 16
    b32 = CLIPConfig.preset("clip-vit-base-patch32")
    assert b32 == CLIPConfig()
    assert (b32.vision_width, b32.vision_layers, b32.vision_heads, b32.vision_mlp_features) == (768, 12, 12, 3072)
    assert (b32.text_width, b32.text_layers, b32.text_heads, b32.text_mlp_features) == (512, 12, 8, 2048)
    assert (b32.projection_dim, b32.vocab_size, b32.max_len, b32.image_size) == (512, 49408, 77, 224)
    assert b32.activation == "quick_gelu" and b32.logit_scale_init == pytest.approx(math.log(1 / 0.07), abs=1e-4)
    # HF CLIPModel's counts (OpenAI's checkpoints)
    assert b32.num_params() == 151_277_313
    assert CLIPConfig.preset("clip-vit-base-patch16").num_params() == 149_620_737
    assert CLIPConfig.preset("clip-vit-large-patch14").num_params() == 427_616_513
    assert TINY.num_params() == param_count(TINY) == 177_409
    tables = (512 + 32) * 64 + 17 * 64                 # token + text positions + image positions
    assert TINY.num_params(non_embedding=True) == TINY.num_params() - tables
    layers = {p for p, _, _ in TINY.layer_stacks}
    assert layers == {("vision",), ("text",)}


def test_flops_golden():
    cfg = TINY
    d, f, e = 64, 128, 32
    layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d          # the same in both towers
    vision = (6 * (4 * 4 * 3 * d) * 16 + 6 * (2 * layer + 2 * d) * 17 + 12 * 2 * d * 17 * 17
              + 6 * d * e)
    text = 6 * (2 * layer + 2 * d) * 10 + 12 * 2 * d * 10 * 10 + 6 * d * e
    assert cfg.flops_per_example(10) == vision + text
    assert cfg.flops_per_token(10) == pytest.approx((vision + text) / 10)
    assert cfg.flops_per_example() == cfg.flops_per_example(32)


@pytest.mark.parametrize("overrides, match", [
    (dict(image_size=18), "not a multiple of patch_size"),
    (dict(text_width=66), r"text_width=66 is not divisible by text_heads"),
    (dict(vision_width=66), r"vision_width=66 is not divisible by vision_heads"),
    (dict(eos_token_id=512), r"eos_token_id=512 is outside the vocabulary \[0, 512\)"),
    (dict(pad_token_id=-1), r"pad_token_id must be an integer >= 0 or None"),
    (dict(activation="swishy"), "activation=.swishy. is unknown"),
    (dict(text_pooling="mean"), "text_pooling=.mean. is unknown"),
    (dict(projection_dim=0), "projection_dim must be an integer >= 1"),
    (dict(logit_scale_init=float("nan")), "logit_scale_init must be a finite number"),
])
def test_config_errors(overrides, match):
    with pytest.raises(UserError, match=match):
        CLIPConfig.preset("tiny", **overrides)


def test_vit_defaults_unchanged_and_the_clip_options():
    """The plain ViT keeps its parameters (a patch bias, no embedding norm) and count; the
    CLIP options add and remove exactly those."""
    cfg = ViTConfig.preset("tiny")
    assert (cfg.patch_bias, cfg.embedding_norm) == (True, False)
    x = jnp.zeros((1, 16, 16, 3))
    plain = jax.eval_shape(lambda: ViT(cfg).init(jax.random.PRNGKey(0), x))["params"]
    assert sorted(plain) == ["cls", "embedding", "encoder_norm", "encoderblock_0",
                             "encoderblock_1", "head", "pos_embedding"]
    assert sorted(plain["embedding"]) == ["bias", "kernel"]
    assert cfg.num_params() == 72_010 and ViTConfig.preset("B/16").num_params() == 86_567_656
    clip_like = cfg.replace(patch_bias=False, embedding_norm=True)
    other = jax.eval_shape(lambda: ViT(clip_like).init(jax.random.PRNGKey(0), x))["params"]
    assert set(other) - set(plain) == {"embedding_norm"} and sorted(other["embedding"]) == ["kernel"]
    assert clip_like.num_params() == cfg.num_params() - 64 + 2 * 64
    assert TINY.vision_config.replace(patch_bias=True, embedding_norm=False) == ViTConfig.preset(
        "tiny", num_classes=0, activation="quick_gelu", norm_eps=1e-5)


# ----------------------------------------------------------------------------- pure functions

def test_pooled_positions_golden():
    ids = jnp.array([[5, 9, 1, 0, 1], [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]])
    np.testing.assert_array_equal(pooled_positions(ids, 1), [2, 0, 0])       # first eos; none: 0
    np.testing.assert_array_equal(pooled_positions(ids, 7), [0, 0, 0])
    np.testing.assert_array_equal(pooled_positions(ids, 5), [0, 4, 0])
    np.testing.assert_array_equal(pooled_positions(ids, 2), [0, 1, 0])
    # "argmax": the largest id, its first occurrence (whatever the eos id)
    np.testing.assert_array_equal(pooled_positions(ids, 1, "argmax"), [1, 4, 0])
    with pytest.raises(UserError, match="unknown text pooling"):
        pooled_positions(ids, 1, "mean")
    x = jnp.array([[3.0, 4.0], [0.0, -2.0]])
    np.testing.assert_allclose(l2_normalize(x), [[0.6, 0.8], [0.0, -1.0]], rtol=1e-7)


# ----------------------------------------------------------------------------- the model

def test_forward_shapes_and_equivalences(params):
    ids, mask = captions(0)
    px = images(0)
    out = apply_fn(TINY)(params, ids, px, mask)
    assert {k: v.shape for k, v in out.items()} == {
        "logits_per_image": (2, 3), "logits_per_text": (3, 2), "image_embeds": (2, 32),
        "text_embeds": (3, 32), "logit_scale": ()}
    assert all(v.dtype == jnp.float32 for v in out.values())
    np.testing.assert_array_equal(out["logits_per_text"], out["logits_per_image"].T)
    image_features = apply_fn(TINY, "encode_image")(params, px)
    text_features = apply_fn(TINY, "encode_text")(params, ids, mask)
    assert image_features.shape == (2, 32) and text_features.shape == (3, 32)
    assert float(jnp.abs(jnp.linalg.norm(image_features, axis=-1) - 1).min()) > 1e-2  # not unit
    np.testing.assert_allclose(out["image_embeds"], l2_normalize(image_features), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["text_embeds"], l2_normalize(text_features), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jnp.linalg.norm(out["text_embeds"], axis=-1), 1.0, rtol=1e-6)
    scale = float(np.exp(np.float32(params["logit_scale"])))
    assert float(out["logit_scale"]) == pytest.approx(scale, rel=1e-6) and scale < MAX_LOGIT_SCALE
    np.testing.assert_allclose(out["logits_per_image"],
                               scale * out["image_embeds"] @ out["text_embeds"].T, rtol=1e-5, atol=1e-6)
    assert float(jnp.std(out["logits_per_image"])) > 0.1


def test_logit_scale_init_and_clamp(params):
    init = CLIP(TINY).init(jax.random.PRNGKey(0), method=lambda m: m.logit_scale)["params"]
    assert float(nn.meta.unbox(init["logit_scale"])) == pytest.approx(2.6592)
    ids, _ = captions(1)
    px = images(1)
    hot = dict(params, logit_scale=jnp.float32(math.log(1000.0)))
    model = CLIP(TINY)

    def total(scale, rest):          # the gradient w.r.t. logit_scale alone
        out = model.apply({"params": {**rest, "logit_scale": scale}}, ids, px)
        return out["logits_per_image"].sum(), out
    value_and_grad = jax.jit(jax.value_and_grad(total, has_aux=True))
    (_, out), grad = value_and_grad(hot["logit_scale"], hot)
    assert float(out["logit_scale"]) == MAX_LOGIT_SCALE
    np.testing.assert_allclose(out["logits_per_image"],
                               100.0 * out["image_embeds"] @ out["text_embeds"].T, rtol=1e-5, atol=1e-5)
    assert float(grad) == 0.0                                     # clamped: no gradient
    (_, out), grad = value_and_grad(params["logit_scale"], params)
    assert float(out["logit_scale"]) < MAX_LOGIT_SCALE
    np.testing.assert_allclose(float(grad), float(out["logits_per_image"].sum()), rtol=1e-5)


def test_text_pools_at_the_eos_token(params):
    """The caption is its end-of-text state: tokens after it (and their mask) change
    nothing (causal attention); a token before it does; "argmax" pooling reads the largest id."""
    encode = apply_fn(TINY, "encode_text")
    ids, mask = captions(2)
    ref = encode(params, ids, mask)
    after = ids.copy()
    after[1, -1] = 77                                            # row 1's eos is at T - 3
    np.testing.assert_array_equal(encode(params, after, mask), ref)
    np.testing.assert_allclose(encode(params, ids, None), ref, rtol=1e-6, atol=1e-7)  # right padding
    before = ids.copy()
    before[1, 0] = 78
    changed = np.asarray(encode(params, before, mask))
    assert np.abs(changed[1] - ref[1]).max() > 1e-3 and np.array_equal(changed[0], ref[0])
    # a key before the eos masked out changes the caption
    holes = mask.copy()
    holes[0, 0] = 0
    assert np.abs(np.asarray(encode(params, ids, holes))[0] - ref[0]).max() > 1e-4
    # argmax pooling reads the largest id: here the one 511, at position 4
    top = np.minimum(ids, 500)
    top[:, 4] = 511
    legacy = apply_fn(TINY.replace(text_pooling="argmax"), "encode_text")(params, top, None)
    np.testing.assert_array_equal(
        legacy, apply_fn(TINY.replace(eos_token_id=511), "encode_text")(params, top, None))
    assert float(jnp.abs(legacy - encode(params, top, None)).max()) > 1e-3


def test_scan_and_remat_match_unscanned(params):
    ids, mask = captions(3)
    px = images(3)
    ref = apply_fn(TINY)(params, ids, px, mask)["logits_per_image"]
    scanned_cfg = TINY.replace(scan_layers=True)
    stacked = to_config_layout(params, scanned_cfg)
    assert stacked["text"]["layers"]["mlp"]["wi"]["kernel"].shape == (2, 64, 128)
    assert stacked["vision"]["encoderblock"]["self_attn"]["query"]["kernel"].shape == (2, 64, 4, 16)
    for cfg in (scanned_cfg, scanned_cfg.replace(remat=True)):
        out = apply_fn(cfg)(stacked, ids, px, mask)["logits_per_image"]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_bf16_runs_close(params):
    ids, mask = captions(4)
    px = images(4)
    ref = apply_fn(TINY)(params, ids, px, mask)
    low = apply_fn(TINY.replace(dtype="bfloat16"))(params, ids, px, mask)
    assert low["logits_per_image"].dtype == jnp.float32
    np.testing.assert_allclose(low["logits_per_image"], ref["logits_per_image"], atol=0.1)


def test_lora_in_both_towers_and_through_the_methods(params):
    cfg = TINY.replace(lora=LoraConfig(rank=2, targets="attn/(query|value)|projection"))
    model = CLIP(cfg)
    ids, mask = captions(5)
    px = images(5)
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
    adapted = {"/".join(str(k.key) for k in path[:-1])
               for path, _ in jax.tree_util.tree_leaves_with_path(shapes) if path[-1].key == "lora_a"}
    assert adapted == ({f"text/layers_{i}/self_attn/{p}" for i in (0, 1) for p in ("query", "value")}
                       | {f"vision/encoderblock_{i}/self_attn/{p}" for i in (0, 1) for p in ("query", "value")}
                       | {"visual_projection", "text_projection"})
    lora_params = _merge_adapters(params, shapes, seed=6)
    base = apply_fn(TINY, "encode_image")(params, px)
    adapted_image = apply_fn(cfg, "encode_image")(lora_params, px)
    assert float(jnp.abs(adapted_image - base).max()) > 1e-3
    out = apply_fn(cfg)(lora_params, ids, px, mask)
    np.testing.assert_allclose(out["image_embeds"], l2_normalize(adapted_image), rtol=1e-6, atol=1e-7)
    text = apply_fn(TINY)(params, ids, px, mask)["text_embeds"]
    assert float(jnp.abs(out["text_embeds"] - text).max()) > 1e-3


def _merge_adapters(base, shapes, seed):
    """``base`` plus random ``lora_a``/``lora_b`` leaves (B non-zero) where ``shapes`` has them."""
    rng = np.random.default_rng(seed)

    def walk(b, f):
        out = {k: walk(b[k], v) if isinstance(v, dict) else b[k] for k, v in f.items()
               if k not in ("lora_a", "lora_b")}
        for k in ("lora_a", "lora_b"):
            if k in f:
                out[k] = jnp.asarray(0.2 * rng.standard_normal(f[k].shape), jnp.float32)
        return out
    return walk(base, shapes)


def test_bad_inputs_are_clear_errors(params):
    model = CLIP(TINY)
    ids, mask = captions(6)
    px = images(6)
    with pytest.raises(UserError, match=r"input_ids\[0, 2\] = 600 is outside the vocabulary "
                                        r"\[0, 512\) of CLIPConfig.vocab_size"):
        model.apply({"params": params}, np.where(np.arange(10) == 2, 600, ids), px)
    with pytest.raises(UserError, match=r"sequence length 33 exceeds the model's max_len=32"):
        model.apply({"params": params}, np.ones((1, 33), np.int32), px)
    with pytest.raises(UserError, match=r"attention_mask must have the shape of input_ids"):
        model.apply({"params": params}, ids, px, mask[:, :5])
    with pytest.raises(UserError, match=r"NCHW.*transpose"):
        model.apply({"params": params}, px.transpose(0, 3, 1, 2), method="encode_image")
    err, _ = jax.jit(checked(functools.partial(model.apply, method="encode_text")))(
        {"params": params}, jnp.asarray(np.where(np.arange(10) == 3, -1, ids)))
    with pytest.raises(Exception, match=r"input_ids\[0, 3\] = -1 is outside the vocabulary"):
        err.throw()


def test_resize_params_and_logical_axes(params):
    cfg24, params24 = resize_params(params, TINY, 24)
    assert cfg24.image_size == 24 and params24["vision"]["pos_embedding"].shape == (37, 64)
    np.testing.assert_array_equal(params24["text"]["final_norm"]["scale"],
                                  params["text"]["final_norm"]["scale"])
    out = apply_fn(cfg24, "encode_image")(params24, images(7, cfg=cfg24))
    assert out.shape == (2, 32) and np.all(np.isfinite(np.asarray(out)))
    boxed = jax.eval_shape(lambda: CLIP(TINY).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                                                   jnp.zeros((1, 16, 16, 3))))["params"]
    names = lambda x: tuple(x.names)  # noqa: E731
    assert names(boxed["visual_projection"]["kernel"]) == ("embed", None)
    assert names(boxed["text"]["token_embedding"]["embedding"]) == ("vocab", "embed")
    assert names(boxed["text"]["layers_0"]["self_attn"]["query"]["kernel"]) == ("embed", "heads", "head_dim")
    assert names(boxed["logit_scale"]) == ()
    assert isinstance(boxed["logit_scale"], nn.LogicallyPartitioned)
