"""ViT parity with Hugging Face ``ViTForImageClassification`` (PyTorch), through ``interop``.

The HF models and tolerances come from ``conftest.py`` (random weights moved off HF's init,
so that every mapping is exercised). HF takes NCHW ``pixel_values``; our ViT takes NHWC,
so images are transposed with (0, 2, 3, 1).
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.interop.hf.vit import vit_to_state_dict
from transformer_jax.models.vit import ViT, ViTConfig, resize_pos_embedding

from .conftest import (ATOL, GRAD_ATOL, GRAD_RTOL, RTOL, assert_gradients_match,
                       assert_strict_round_trip, abstract_param_count, meta_param_count,
                       run_without_torch, state_dict, torch, transformers, vit_model)


def random_images(seed, batch=3, size=16, channels=3) -> np.ndarray:
    """NCHW float32, HF's layout."""
    return np.random.default_rng(seed).standard_normal((batch, channels, size, size)).astype(np.float32)


def nhwc(x):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def hf_logits(model, pixels, **kw) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(pixels), **kw).logits.numpy()


@functools.lru_cache(maxsize=None)
def _jitted_apply(module):
    return jax.jit(module.apply)


def our_logits(module, params, pixels) -> np.ndarray:
    return np.asarray(_jitted_apply(module)({"params": params}, nhwc(pixels)))


@pytest.fixture(scope="module")
def hf_model():
    return vit_model()


@pytest.fixture(scope="module")
def converted(hf_model):
    return from_hf(hf_model)


# ----------------------------------------------------------------------------- forward

def test_config_mapping(hf_model, converted):
    module, _ = converted
    cfg = module.config
    assert isinstance(module, ViT)
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.mlp_features) == (32, 2, 4, 64)
    assert (cfg.image_size, cfg.patch_size, cfg.num_channels, cfg.num_classes) == (16, 4, 3, 5)
    assert cfg.activation == "gelu" and cfg.norm_eps == 1e-12
    back = hf_config(cfg)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "image_size", "patch_size", "num_channels", "num_labels", "hidden_act",
                 "layer_norm_eps", "qkv_bias", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        assert getattr(back, name) == getattr(hf_model.config, name), name


def test_logits_parity(hf_model, converted):
    pixels = random_images(0)
    ours, theirs = our_logits(*converted, pixels), hf_logits(hf_model, pixels)
    assert np.abs(theirs).max() > 0.3
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_scan_layers_conversion(hf_model, converted):
    smod, sparams = from_hf(hf_model, scan_layers=True)
    assert "encoderblock" in sparams and "encoderblock_0" not in sparams
    pixels = random_images(1)
    np.testing.assert_allclose(our_logits(smod, sparams, pixels), hf_logits(hf_model, pixels),
                               rtol=RTOL, atol=ATOL)
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(*converted)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_vit_model_without_head_gives_the_cls_representation():
    base = vit_model(seed=1, cls=lambda c: transformers.ViTModel(c, add_pooling_layer=False))
    module, params = from_hf(base)
    assert module.config.num_classes == 0 and "head" not in params
    pixels = random_images(2)
    with torch.no_grad():
        cls = base(torch.from_numpy(pixels)).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(our_logits(module, params, pixels), cls, rtol=RTOL, atol=ATOL)
    # back to HF: a ViTForImageClassification with num_labels=0 (identity classifier)
    headless = transformers.ViTForImageClassification(hf_config(module.config)).eval()
    headless.load_state_dict(to_hf(module, params), strict=True)
    np.testing.assert_array_equal(hf_logits(headless, pixels), cls)


def test_pooler_is_rejected_unless_dropped():
    base = vit_model(seed=2, cls=transformers.ViTModel)          # add_pooling_layer=True
    with pytest.raises(ValueError, match=r"pooler.*drop_pooler=True"):
        from_hf(base)
    module, params = from_hf(base, drop_pooler=True)
    assert module.config.num_classes == 0


# ----------------------------------------------------------------------------- gradients

def test_gradient_parity_params_and_image(hf_model, converted):
    module, params = converted
    pixels = random_images(3, batch=4)
    labels = np.array([0, 3, 4, 1])

    def loss_fn(p, x):
        logits = module.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    jax_loss, (jax_grads, jax_image_grad) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(
        params, jnp.asarray(nhwc(pixels)))

    hf_model.zero_grad()
    x = torch.from_numpy(pixels).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(hf_model(x).logits, torch.as_tensor(labels))
    loss.backward()
    np.testing.assert_allclose(float(jax_loss), loss.item(), rtol=RTOL)
    torch_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    _, mapped = from_hf_state_dict(hf_model.config, torch_grads)
    hf_model.zero_grad()
    assert assert_gradients_match(jax_grads, mapped, params) == 40
    image_grad = nhwc(x.grad.numpy())
    assert np.abs(image_grad).max() > 1e-4
    np.testing.assert_allclose(np.asarray(jax_image_grad), image_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(hf_model, converted):
    module, params = converted
    assert_strict_round_trip(hf_model, module, params, transformers.ViTForImageClassification,
                             hf_logits, random_images(4))


def test_legacy_layout_round_trip_and_hf_loads_it(hf_model, converted, tmp_path):
    """transformers 4.x / hub key names: we read them, and HF itself maps them to ours."""
    from safetensors.numpy import save_file

    module, params = converted
    legacy = vit_to_state_dict(module, params, layout="legacy")
    assert "vit.encoder.layer.1.attention.attention.query.weight" in legacy
    assert "vit.encoder.layer.0.intermediate.dense.weight" in legacy
    _, back = from_hf_state_dict(hf_model.config, legacy)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(back),
                                 jax.tree_util.tree_leaves_with_path(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    save_file(legacy, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    loaded = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    pixels = random_images(5)
    np.testing.assert_array_equal(hf_logits(loaded, pixels), hf_logits(hf_model, pixels))


def test_load_save_pretrained_dir_without_torch(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    pixels = random_images(6)
    np.save(tmp_path / "images.npy", nhwc(pixels))
    run_without_torch("""
        images = np.load(sys.argv[2])
        np.save(sys.argv[3], np.asarray(module.apply({"params": params}, images)))
    """, tmp_path / "ckpt", tmp_path / "images.npy", tmp_path / "out.npy")
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), hf_logits(hf_model, pixels),
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- position resizing

@pytest.mark.parametrize("size", [24, 8, 20])
def test_resize_on_load_matches_hf_interpolate_pos_encoding(hf_model, size):
    """HF interpolates bicubically at run time; we resize the table once on load: same logits."""
    module, params = from_hf(hf_model, image_size=size)
    assert module.config.image_size == size and params["pos_embedding"].shape == ((size // 4) ** 2 + 1, 32)
    pixels = random_images(7, size=size)
    np.testing.assert_allclose(our_logits(module, params, pixels),
                               hf_logits(hf_model, pixels, interpolate_pos_encoding=True),
                               rtol=RTOL, atol=ATOL)


def test_resize_pos_embedding_equals_hf_function(hf_model):
    emb = hf_model.vit.embeddings
    table = emb.position_embeddings.detach().numpy()                        # (1, 17, 32)
    with torch.no_grad():
        theirs = emb.interpolate_pos_encoding(torch.zeros(1, 50, 32), 28, 28).numpy()   # 7x7 grid
    ours = np.asarray(resize_pos_embedding(table, 7))
    assert ours.shape == theirs.shape == (1, 50, 32)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        bilinear = torch.nn.functional.interpolate(
            torch.from_numpy(table[0, 1:].reshape(4, 4, 32)).permute(2, 0, 1)[None], size=(7, 7),
            mode="bilinear", align_corners=False)[0].permute(1, 2, 0).reshape(49, 32).numpy()
    np.testing.assert_allclose(np.asarray(resize_pos_embedding(table[0], 7, method="bilinear"))[1:],
                               bilinear, rtol=1e-6, atol=1e-6)


def test_task_starts_from_a_pretrained_hf_dir(tmp_path):
    """Fine-tuning start: HF weights, position table resized to the task's size, new head."""
    from transformer_jax.models.vit import init_params
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import ExperimentConfig, apply_overrides

    gray = vit_model(seed=4, num_channels=1)                   # 5 classes, 16 px, like digits' 1 channel
    gray.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = apply_overrides(ExperimentConfig(model_overrides={}), [
        "task=image_classification", "model=vit", "model_preset=tiny", "dataset=digits",
        "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "model.norm_eps=1e-12",
        "task.image_size=24", f"task.pretrained={tmp_path / 'hf'}"])
    task = make_task(cfg, tmp_path / "run")
    fresh = jax.jit(lambda k: init_params(ViT(task.model_config), k))(jax.random.PRNGKey(0))
    out = task.init_params(fresh)
    _, want = from_hf(gray, image_size=24)
    np.testing.assert_array_equal(np.asarray(out["pos_embedding"]), np.asarray(want["pos_embedding"]))
    assert out["pos_embedding"].shape == (37, 32)
    np.testing.assert_array_equal(np.asarray(out["encoderblock_1"]["mlp"]["wo"]["kernel"]),
                                  np.asarray(want["encoderblock_1"]["mlp"]["wo"]["kernel"]))
    assert out["head"]["kernel"].shape == (32, 10)            # 5 -> 10 classes: the fresh head
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), 0.0)
    rgb = cfg.replace(model_overrides={**cfg.model_overrides, "mlp_dim": 48})
    with pytest.raises(ValueError, match=r"mlp.*shape"):
        wrong = make_task(rgb, tmp_path / "run2")
        wrong.init_params(jax.eval_shape(lambda: init_params(ViT(wrong.model_config), jax.random.PRNGKey(0))))


# ----------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("name", sorted(ViTConfig.PRESETS))
def test_parameter_counts_match_hf(name):
    cfg = ViTConfig.preset(name)
    hf_count = meta_param_count(lambda: transformers.ViTForImageClassification(hf_config(cfg)))
    images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels))
    scanned = ViT(cfg.replace(scan_layers=True))                 # same count, a quicker trace
    ours = abstract_param_count(lambda: scanned.init(jax.random.PRNGKey(0), images))
    assert cfg.num_params() == ours == hf_count
    pooled = meta_param_count(lambda: transformers.ViTModel(hf_config(cfg)))  # ViTModel: a pooler
    assert pooled == hf_count - (cfg.d_model + 1) * (cfg.num_classes - cfg.d_model)


# ----------------------------------------------------------------------------- bad input

def test_unknown_missing_and_misshapen_keys_raise(hf_model):
    sd = state_dict(hf_model)
    sd["vit.embeddings.mask_token"] = torch.zeros(1, 1, 32)
    with pytest.raises(ValueError, match=r"vit\.embeddings\.mask_token"):
        from_hf_state_dict(hf_model.config, sd)
    sd = state_dict(hf_model)
    del sd["vit.layers.1.mlp.fc1.bias"]
    with pytest.raises(ValueError, match=r"vit\.layers\.1\.mlp\.fc1\.bias"):
        from_hf_state_dict(hf_model.config, sd)
    sd = state_dict(hf_model)
    sd["vit.embeddings.patch_embeddings.projection.weight"] = torch.zeros(32, 3, 8, 8)
    with pytest.raises(ValueError, match=r"projection\.weight.*\(32, 3, 8, 8\).*\(32, 3, 4, 4\)"):
        from_hf_state_dict(hf_model.config, sd)


@pytest.mark.parametrize("option, value", [("qkv_bias", False), ("hidden_act", "mish"),
                                           ("image_size", [16, 32]), ("model_type", "deit")])
def test_unsupported_config_option_raises(hf_model, option, value):
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(ValueError, match=option if option != "model_type" else "deit"):
        from_hf_state_dict(config, state_dict(hf_model))


def test_patch_size_cannot_change_on_load(hf_model):
    with pytest.raises(ValueError, match="patch_size"):
        from_hf(hf_model, patch_size=8)
