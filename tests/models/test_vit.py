"""ViT: presets, forward pass, position-embedding resizing, the image data and task."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import images as image_data
from transformer_jax.models import FAMILIES, build_model
from transformer_jax.layers.stack import stack_layers
from transformer_jax.models.vit import (ViT, ViTConfig, adapt_pretrained, init_params,
                                        interpolation_matrix, resize_params, resize_pos_embedding)
from transformer_jax.tasks.image_classification import image_classification_loss
from transformer_jax.train.config import ExperimentConfig, apply_overrides, load_experiment
from transformer_jax.train.optim import constant, make_optimizer
from transformer_jax.train.step import create_train_state, eval_step, make_train_step

TINY = ViTConfig.preset("tiny")


def param_count(cfg: ViTConfig) -> int:
    """Leaves of the built model (scanned: the same count, a quicker trace of deep models)."""
    cfg = cfg.replace(scan_layers=True)
    images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels))
    shapes = nn.meta.unbox(jax.eval_shape(lambda: ViT(cfg).init(jax.random.PRNGKey(0), images))["params"])
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


def random_images(seed, cfg=TINY, batch=3):
    shape = (batch, cfg.image_size, cfg.image_size, cfg.num_channels)
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def perturbed(params, seed=0, scale=0.1):
    """Params moved off the init (zero head, unit norms) so that every leaf matters."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape).astype(np.float32)),
        params)


@functools.lru_cache(maxsize=None)
def apply_fn(cfg: ViTConfig, deterministic: bool = True):
    """A jitted ``ViT(cfg).apply`` (one compile per config instead of many eager ops)."""
    return jax.jit(functools.partial(ViT(cfg).apply, deterministic=deterministic))


def forward(cfg, params, x, **kw):
    return apply_fn(cfg, **kw)({"params": params}, x)


@pytest.fixture(scope="module")
def tiny_params():
    return perturbed(jax.jit(lambda k: init_params(ViT(TINY), k))(jax.random.PRNGKey(0)))


# ----------------------------------------------------------------------------- config

def test_presets_decode_the_variant_table():
    b16 = ViTConfig.preset("B/16")
    assert (b16.d_model, b16.num_layers, b16.num_heads, b16.mlp_features, b16.patch_size) == (768, 12, 12, 3072, 16)
    assert (b16.image_size, b16.grid_size, b16.seq_len, b16.num_classes) == (224, 14, 197, 1000)
    l32 = ViTConfig.preset("L/32", num_classes=10)
    assert (l32.d_model, l32.num_layers, l32.num_heads, l32.mlp_features, l32.patch_size) == (1024, 24, 16, 4096, 32)
    assert l32.num_classes == 10 and l32.seq_len == 50
    ti, s = ViTConfig.preset("Ti/16"), ViTConfig.preset("S/32")
    assert (ti.d_model, ti.num_heads, ti.mlp_features) == (192, 3, 768)
    assert (s.d_model, s.num_heads, s.mlp_features, s.patch_size) == (384, 6, 1536, 32)
    assert sorted(ViTConfig.PRESETS) == sorted(
        ["tiny"] + [f"{v}/{p}" for v in ("Ti", "S", "B", "L") for p in (16, 32)])
    assert FAMILIES["vit"] == (ViTConfig, ViT)
    assert build_model("vit", "tiny", {"num_classes": 3})[0].num_classes == 3


@pytest.mark.parametrize("name", sorted(ViTConfig.PRESETS))
def test_num_params_equals_the_built_model(name):
    cfg = ViTConfig.preset(name)
    assert cfg.num_params() == param_count(cfg)
    headless = cfg.replace(num_classes=0)
    assert headless.num_params() == param_count(headless) == cfg.num_params() - (cfg.d_model + 1) * cfg.num_classes


def test_num_params_and_flops_golden():
    assert ViTConfig.preset("B/16").num_params() == 86_567_656      # ViT-B/16, 1000 classes
    assert ViTConfig.preset("L/16").num_params() == 304_326_632
    cfg = TINY
    d, f, layer = 64, 128, 4 * 64 * 64 + 4 * 64 + 2 * 64 * 128 + 128 + 64 + 4 * 64
    per_image = (6 * (4 * 4 * 3 * d + d) * 16 + 6 * (2 * layer + 2 * d) * 17 + 6 * (d * 10 + 10)
                 + 12 * 2 * d * 17 * 17)
    assert cfg.flops_per_image() == per_image
    assert cfg.flops_per_token() == pytest.approx(per_image / 17)


@pytest.mark.parametrize("overrides, match", [
    (dict(image_size=30), "not a multiple of patch_size"),
    (dict(d_model=66), "not divisible by num_heads"),
    (dict(num_classes=-1), "num_classes"),
    (dict(activation="swishy"), "activation=.swishy. is unknown"),
    (dict(dtype="float17"), "unknown dtype"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig.preset("tiny", **overrides)
    with pytest.raises(ValueError, match=r"Did you mean 'B/16'"):
        ViTConfig.preset("B/61")


# ----------------------------------------------------------------------------- model

def test_forward_shapes_dtypes_and_init(tiny_params):
    fresh = jax.jit(lambda k: init_params(ViT(TINY), k))(jax.random.PRNGKey(1))
    assert fresh["embedding"]["kernel"].shape == (4, 4, 3, 64)             # HWIO
    assert fresh["pos_embedding"].shape == (17, 64) and fresh["cls"].shape == (64,)
    assert not np.any(np.asarray(fresh["head"]["kernel"]))                # big_vision zero head
    x = random_images(0)
    np.testing.assert_array_equal(np.asarray(forward(TINY, fresh, x)), 0.0)
    logits = forward(TINY, tiny_params, x)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32
    assert float(jnp.std(logits)) > 0.1
    low = forward(TINY.replace(dtype="bfloat16"), tiny_params, x)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(low), np.asarray(logits), atol=0.1 * float(jnp.abs(logits).max()))
    rep = forward(TINY.replace(num_classes=0), {k: v for k, v in tiny_params.items() if k != "head"}, x)
    assert rep.shape == (3, 64) and rep.dtype == jnp.float32


def test_patch_embedding_is_the_strided_convolution(tiny_params):
    """Our reshape + Dense equals lax.conv (HWIO kernel, stride = kernel = P) on NHWC images."""
    x = random_images(1)
    kernel, bias = tiny_params["embedding"]["kernel"], tiny_params["embedding"]["bias"]
    conv = jax.lax.conv_general_dilated(x, kernel, (4, 4), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + bias
    captured = jax.jit(lambda p, x: ViT(TINY).apply({"params": p}, x, capture_intermediates=True,
                                                    mutable=["intermediates"]))(tiny_params, x)
    captured = captured[1]["intermediates"]
    ours = captured["embedding"]["__call__"][0]                               # (B, N, D)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(conv.reshape(3, 16, 64)), rtol=1e-5, atol=1e-5)


def test_scan_and_remat_match_unscanned(tiny_params):
    x = random_images(2)
    ref = forward(TINY, tiny_params, x)
    stacked = stack_layers(tiny_params, TINY.num_layers, name="encoderblock")
    for cfg in (TINY.replace(scan_layers=True), TINY.replace(scan_layers=True, remat=True)):
        np.testing.assert_allclose(np.asarray(forward(cfg, stacked, x)),
                                   np.asarray(ref), rtol=1e-5, atol=1e-5)
    out = forward(TINY.replace(remat=True), tiny_params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    images = jnp.zeros((1, 16, 16, 3))
    scanned = jax.eval_shape(lambda: ViT(TINY.replace(scan_layers=True)).init(jax.random.PRNGKey(0), images))
    assert scanned["params"]["encoderblock"]["self_attn"]["query"]["kernel"].value.shape == (2, 64, 4, 16)


def test_logical_axis_names():
    images = jnp.zeros((1, 16, 16, 3))
    boxed = jax.eval_shape(lambda: ViT(TINY).init(jax.random.PRNGKey(0), images))["params"]
    names = lambda x: tuple(x.names)  # noqa: E731
    assert names(boxed["embedding"]["kernel"]) == (None, None, None, "embed")
    assert names(boxed["pos_embedding"]) == (None, "embed") and names(boxed["cls"]) == ("embed",)
    assert names(boxed["encoderblock_0"]["self_attn"]["query"]["kernel"]) == ("embed", "heads", "head_dim")
    assert names(boxed["encoderblock_0"]["mlp"]["wi"]["kernel"]) == ("embed", "mlp")
    assert names(boxed["head"]["kernel"]) == ("embed", None)


def test_bad_images_are_clear_errors(tiny_params):
    model = ViT(TINY)
    with pytest.raises(ValueError, match=r"NCHW.*transpose"):
        model.apply({"params": tiny_params}, jnp.zeros((2, 3, 16, 16)))
    with pytest.raises(ValueError, match=r"resize_params"):
        model.apply({"params": tiny_params}, jnp.zeros((2, 24, 24, 3)))
    with pytest.raises(ValueError, match=r"NHWC"):
        model.apply({"params": tiny_params}, jnp.zeros((16, 16, 3)))


def test_dropout_is_active_only_when_not_deterministic(tiny_params):
    cfg = TINY.replace(dropout_rate=0.3, attention_dropout_rate=0.3)
    x = random_images(3)
    a = forward(cfg, tiny_params, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(forward(cfg, tiny_params, x)))
    b = apply_fn(cfg, False)({"params": tiny_params}, x, rngs={"dropout": jax.random.PRNGKey(0)})
    assert float(jnp.abs(a - b).max()) > 1e-3


# ----------------------------------------------------------------------------- resizing

def test_interpolation_matrices_golden():
    # bilinear 2 -> 3 (half-pixel centres): ends copy the border, the middle averages
    np.testing.assert_allclose(interpolation_matrix(2, 3, "bilinear"),
                               [[1, 0], [0.5, 0.5], [0, 1]], atol=1e-12)
    # bicubic 2 -> 4, a = -0.75, clamped border taps (hand-derived Keys weights)
    w = interpolation_matrix(2, 4, "bicubic")
    np.testing.assert_allclose(w @ np.array([0.0, 1.0]),
                               [-0.10546875, 0.2265625, 0.7734375, 1.10546875], atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    for method in ("bilinear", "bicubic"):
        np.testing.assert_allclose(interpolation_matrix(5, 5, method), np.eye(5), atol=1e-12)
    with pytest.raises(ValueError, match="unknown interpolation"):
        interpolation_matrix(2, 3, "lanczos")


def test_resize_pos_embedding_golden_and_identity():
    grid = jnp.arange(4.0).reshape(4, 1)                                  # 2x2 grid, D = 1
    posemb = jnp.concatenate([jnp.full((1, 1), 7.0), grid])              # CLS row first
    out = resize_pos_embedding(posemb, 3, method="bilinear")
    np.testing.assert_allclose(np.asarray(out[:, 0]),
                               [7.0, 0, 0.5, 1, 1, 1.5, 2, 2, 2.5, 3], atol=1e-6)
    big = jax.random.normal(jax.random.PRNGKey(0), (1 + 16, 8))
    np.testing.assert_array_equal(np.asarray(resize_pos_embedding(big, 4)), np.asarray(big))
    # bicubic, non-square target, a leading batch axis (HF's (1, T, D) layout) kept
    up = resize_pos_embedding(big[None], (6, 5))
    assert up.shape == (1, 1 + 30, 8)
    np.testing.assert_array_equal(np.asarray(up[0, 0]), np.asarray(big[0]))
    # bilinear upsampling equals jax.image.resize (big_vision's resampling)
    want = jax.image.resize(big[1:].reshape(4, 4, 8), (7, 7, 8), "bilinear")
    got = resize_pos_embedding(big, 7, method="bilinear")[1:].reshape(7, 7, 8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    with pytest.raises(ValueError, match="not a square grid"):
        resize_pos_embedding(big[:-1], 3)
    with pytest.raises(ValueError, match="old_grid"):
        resize_pos_embedding(big, 3, old_grid=(2, 4))


def test_resize_params_runs_at_the_new_size(tiny_params):
    cfg24, params24 = resize_params(tiny_params, TINY, 24)
    assert cfg24.image_size == 24 and params24["pos_embedding"].shape == (37, 64)
    logits = forward(cfg24, params24, random_images(4, cfg24))
    assert logits.shape == (3, 10) and np.all(np.isfinite(np.asarray(logits)))
    same_cfg, same = resize_params({"params": tiny_params}, TINY, 16)
    np.testing.assert_array_equal(np.asarray(same["params"]["pos_embedding"]),
                                  np.asarray(tiny_params["pos_embedding"]))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        resize_params(tiny_params, TINY, 18)


def test_adapt_pretrained_resizes_and_replaces_the_head(tiny_params):
    target = TINY.replace(image_size=24, num_classes=3, scan_layers=True)
    fresh = jax.jit(lambda k: init_params(ViT(target), k))(jax.random.PRNGKey(5))
    out = adapt_pretrained(fresh, target, tiny_params, TINY)
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), np.asarray(fresh["head"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(out["encoderblock"]["mlp"]["wi"]["kernel"][1]),
                                  np.asarray(tiny_params["encoderblock_1"]["mlp"]["wi"]["kernel"]))
    np.testing.assert_allclose(np.asarray(out["pos_embedding"]),
                               np.asarray(resize_pos_embedding(tiny_params["pos_embedding"], 6)))
    with pytest.raises(ValueError, match=r"norm_eps=1e-12.*set model.norm_eps=1e-06"):
        adapt_pretrained(fresh, target.replace(norm_eps=1e-12), tiny_params, TINY)
    with pytest.raises(ValueError, match="mlp"):
        other = TINY.replace(mlp_dim=96)
        adapt_pretrained(jax.eval_shape(lambda: init_params(ViT(other), jax.random.PRNGKey(0))),
                         other, tiny_params, TINY)


# ----------------------------------------------------------------------------- training

def test_one_train_step_learns():
    model = ViT(TINY.replace(num_channels=1))
    tx = make_optimizer(schedule=constant(3e-3), weight_decay=0.0, clip_norm=1.0)
    state = jax.jit(lambda k: create_train_state(model, tx, k, jnp.zeros((1, 16, 16, 1))))(
        jax.random.PRNGKey(0))
    it = image_data.make_image_iterator("digits", "train", image_size=16, batch_size=32, seed=0)
    batch = next(it)
    step = jax.jit(make_train_step(loss_fn=image_classification_loss))
    state2, metrics = step(state, batch)
    # the zero-initialised head gives uniform predictions: loss = ln(10) exactly
    assert float(metrics["loss"]) == pytest.approx(np.log(10.0), rel=1e-6)
    assert float(metrics["tokens"]) == 32 and float(metrics["grad_norm"]) > 0
    for _ in range(5):
        state2, metrics = step(state2, batch)
    assert float(metrics["loss"]) < np.log(10.0) - 0.15       # it starts to fit the batch
    sums = eval_step(state2.params, batch, model.apply, image_classification_loss)
    assert float(sums["weight"]) == 32 and 0 <= float(sums["correct"]) <= 32


# ----------------------------------------------------------------------------- data

def test_digits_split_is_fixed_and_disjoint():
    train = image_data.digits_split("train")
    test = image_data.digits_split("test")
    assert (len(train), len(test)) == (1438, 359)
    images, labels = image_data.load_digits_arrays()
    assert images.shape == (1797, 8, 8, 1) and images.max() == 16.0

    def rows(imgs, ys):       # each example as one sortable row: 64 pixels, then the label
        return np.concatenate([imgs.reshape(len(ys), -1), ys[:, None]], axis=1)

    def sort_rows(a):
        return a[np.lexsort(a.T[::-1])]
    # the two splits partition the data set: the same multiset of (image, label) rows
    split_rows = np.concatenate([rows(train.images, train.labels), rows(test.images, test.labels)])
    np.testing.assert_array_equal(sort_rows(split_rows), sort_rows(rows(images, labels)))
    np.testing.assert_array_equal(image_data.digits_split("test").labels, test.labels)
    assert not np.array_equal(image_data.digits_split("test", split_seed=1).labels, test.labels)
    with pytest.raises(ValueError, match="eval_split='test'"):
        image_data.digits_split("validation")


def test_preprocess_image_golden():
    img = np.array([[0, 16], [8, 4]], np.float32)
    np.testing.assert_allclose(image_data.preprocess_image(img, 2, max_value=16.0)[..., 0],
                               [[-1, 1], [0, -0.5]])
    wide = np.zeros((10, 20, 3), np.uint8)
    wide[:, 5:15] = 255                                            # the central 10x10 square
    out = image_data.preprocess_image(wide, 10)
    assert out.shape == (10, 10, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, 1.0, atol=1e-6)
    a = image_data.preprocess_image(wide, 8, augment=True, flip=True, rng=np.random.default_rng(0))
    b = image_data.preprocess_image(wide, 8, augment=True, flip=True, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(a, b)


def _batches(it, n):
    return [next(it) for _ in range(n)]


def test_image_iterator_resumes_exactly_and_shards():
    kw = dict(image_size=16, batch_size=64, seed=3, augment=True)
    it = image_data.make_image_iterator("digits", "train", **kw)
    assert it.batches_per_epoch == 22
    _batches(it, 20)
    state = it.get_state()
    ahead = _batches(it, 5)                                         # crosses an epoch boundary
    assert it.get_state() == {"mode": "images", "epoch": 1, "index": 3}
    again = image_data.make_image_iterator("digits", "train", **kw)
    again.set_state(state)
    for a, b in zip(ahead, _batches(again, 5)):
        for k in ("images", "labels", "weights"):
            np.testing.assert_array_equal(a[k], b[k])
    # two processes' rows stacked in process order are the single-process batch
    whole = next(image_data.make_image_iterator("digits", "train", **kw))
    parts = [next(image_data.make_image_iterator("digits", "train", process_index=p,
                                                 process_count=2, **kw)) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([p["images"] for p in parts]), whole["images"])
    np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), whole["labels"])
    with pytest.raises(ValueError, match="out of range"):
        again.set_state({"mode": "images", "epoch": 0, "index": 22})
    with pytest.raises(ValueError, match="not an image-iterator state"):
        again.set_state({"mode": "memory", "epoch": 0, "index": 0})


def test_eval_pass_covers_every_example_once():
    it = image_data.make_image_iterator("digits", "test", image_size=16, batch_size=64,
                                        shuffle=False, repeat=False)
    batches = list(it)
    assert len(batches) == 6 == it.batches_per_epoch
    weights = np.concatenate([b["weights"] for b in batches])
    assert weights.sum() == 359 and np.all(weights[:359] == 1) and np.all(weights[359:] == 0)
    labels = np.concatenate([b["labels"] for b in batches])[:359]
    np.testing.assert_array_equal(labels, image_data.digits_split("test").labels)


def test_mock_tfds_cifar10_and_imagenet_batches(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=20):
        info = image_data.dataset_info("cifar10", data_dir=str(tmp_path))
        assert (info.num_classes, info.num_channels, info.flip, len(info.label_names)) == (10, 3, True, 10)
        batch = next(image_data.make_image_iterator("cifar10", "train", image_size=32, batch_size=8,
                                                    augment=True, data_dir=str(tmp_path)))
        assert batch["images"].shape == (8, 32, 32, 3) and batch["labels"].dtype == np.int32
        assert batch["images"].min() >= -1 and batch["images"].max() <= 1
        # imagenet2012's mock images have random sizes: resized + centre-cropped to S x S
        it = image_data.make_image_iterator("imagenet2012", "validation", image_size=24, batch_size=8,
                                            shuffle=False, repeat=False, data_dir=str(tmp_path))
        got = list(it)
        assert len(got) == 3 and got[0]["images"].shape == (8, 24, 24, 3)
        assert sum(float(b["weights"].sum()) for b in got) == 20
        with pytest.raises(ValueError, match="image-classification dataset"):
            image_data.dataset_info("lm1b", data_dir=str(tmp_path))


# ----------------------------------------------------------------------------- task

TASK_SETS = ["task=image_classification", "model=vit", "model_preset=tiny", "batch_size=8",
             "schedule=constant", "learning_rate=1e-3", "warmup_steps=1", "log_every=1",
             "eval_every=2", "save_every=2", "eval_batches=2"]


def test_image_task_trains_on_mock_cifar10(tmp_path):
    import tensorflow_datasets as tfds

    from transformer_jax.tasks import make_task
    from transformer_jax.workdir import load_run
    from transformer_jax.run import train
    from transformer_jax.train.monitor import read_metrics

    cfg = apply_overrides(ExperimentConfig(model_overrides={}), TASK_SETS + [
        "dataset=cifar10", "eval_split=test", "steps=2", f"data_dir={tmp_path / 'tfds'}",
        "task.augment=true", "task.num_samples=4"])
    with tfds.testing.mock_data(num_examples=24):
        summary = train(cfg, tmp_path / "run", progress=False)
        task = make_task(cfg, tmp_path / "run")
    assert summary["final_step"] == 2 and 0 <= summary["eval_accuracy"] <= 1
    assert summary["eval_tokens"] == 16                       # 2 eval batches of 8 images
    model_cfg = task.model_config
    assert (model_cfg.num_classes, model_cfg.num_channels, model_cfg.image_size) == (10, 3, 16)
    assert task.tokens_per_step() == 8 * 17
    assert task.flops_per_step(model_cfg) == 8 * model_cfg.flops_per_image()
    rows = [r for r in read_metrics(tmp_path / "run") if "mfu" in r]
    assert rows and rows[-1]["tokens_per_s"] > 0
    samples = (tmp_path / "run" / "samples.txt").read_text()
    assert "prediction/label" in samples and len(samples.split("prediction/label")[1].split()) >= 4
    # the workdir alone rebuilds model, params and task (no dataset access needed)
    run_config, model, params, loaded = load_run(tmp_path / "run")
    assert run_config["task_spec"]["image_size"] == 16 and len(loaded.info.label_names) == 10
    out = jax.eval_shape(lambda: model.apply({"params": params}, jnp.zeros((2, 16, 16, 3))))
    assert out.shape == (2, 10)


def test_image_task_config_errors(tmp_path):
    from transformer_jax.tasks import make_task

    base = ExperimentConfig(model_overrides={})
    bad = [
        (["dataset=digits", "model.num_classes=5"], "num_classes=5"),
        (["dataset=digits", "task.image_size=32", "model.image_size=16"], "disagree"),
        (["dataset=digits", "model=gpt", "model_preset=tiny"], "image model"),
        ([], "image dataset"),
        (["dataset=digits", "task.pretrained=/nonexistent"], "neither"),
    ]
    for sets, match in bad:
        cfg = apply_overrides(base, ["task=image_classification", "model=vit", "model_preset=tiny"] + sets)
        with pytest.raises(ValueError, match=match):
            task = make_task(cfg, tmp_path)
            task.init_params({})
    cfg = apply_overrides(base, ["task=image_classification", "model=vit", "model_preset=tiny",
                                 "dataset=digits", "task.image_size=24"])
    task = make_task(cfg, tmp_path)
    assert task.model_config.image_size == 24 and task.model_config.num_channels == 1
    assert task.init_args()[0].shape == (1, 24, 24, 1)


def test_vit_digits_experiment_loads():
    cfg = load_experiment("vit_digits")
    assert (cfg.task, cfg.model, cfg.dataset, cfg.eval_split) == ("image_classification", "vit", "digits", "test")
