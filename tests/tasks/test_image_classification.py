"""The ``image_classification`` task on the offline digits: its batches (pixels x / 16 * 2 - 1,
the test split in order, crops/flips only in training) and its metrics (loss and top-1 accuracy
of a numpy linear classifier, the eval sample). Iterator and training: tests/models/test_vit.py."""
import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data.images import DatasetInfo, dataset_info, digits_split
from transformer_jax.tasks import make_task
from transformer_jax.tasks.image_classification import (ImageClassificationTask,
                                                        image_classification_loss)
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

S, B = 8, 64          # digits are 8 x 8 already: no resize, so pixels are exact


def image_task(tmp_path, seed=0, **options) -> ImageClassificationTask:
    cfg = ExperimentConfig(task="image_classification", model="vit", model_preset="tiny",
                           model_overrides={}, dataset="digits", eval_split="test", batch_size=B,
                           seed=seed,
                           task_options={"image_size": S, **options})
    return make_task(cfg, tmp_path)


def scaled(images: np.ndarray) -> np.ndarray:
    """Digits pixels 0..16 -> [-1, 1]: (B, S, S, 1) float32."""
    return (images.astype(np.float64) / 16.0 * 2.0 - 1.0).astype(np.float32)


def stacked(batches) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


# ----------------------------------------------------------------------------- batches

def test_eval_batches_are_the_scaled_test_split_in_order(tmp_path):
    batches = list(image_task(tmp_path).eval_batches(0, 1))
    test = digits_split("test")                          # 359 of the 1797 digits
    assert len(batches) == math.ceil(359 / B) == 6
    assert set(batches[0]) == {"images", "labels", "weights"}
    assert batches[0]["images"].shape == (B, S, S, 1) and batches[0]["images"].dtype == np.float32
    got = stacked(batches)
    np.testing.assert_array_equal(got["images"][:359], scaled(test.images))
    np.testing.assert_array_equal(got["labels"][:359], test.labels)
    np.testing.assert_array_equal(got["weights"], [1.0] * 359 + [0.0] * (6 * B - 359))
    assert got["images"][:359].min() == -1.0 and got["images"][:359].max() == 1.0
    assert not got["images"][359:].any() and not got["labels"][359:].any()   # padding rows


def test_split_options_reach_the_data(tmp_path):
    task = image_task(tmp_path, test_fraction=0.25, split_seed=1)
    got = stacked(list(task.eval_batches(0, 1)))
    test = digits_split("test", test_fraction=0.25, split_seed=1)
    assert got["weights"].sum() == round(0.25 * 1797) == len(test.labels) == 449
    np.testing.assert_array_equal(got["labels"][:449], test.labels)
    np.testing.assert_array_equal(got["images"][:449], scaled(test.images))


def test_data_workers_reach_the_iterator_and_digits_default_to_this_process(tmp_path):
    """``data_workers`` (ExperimentConfig) is the iterator's worker count; digits (in-memory
    arrays) stay in the training process by default. Equality of the batches: tests/data/
    test_image_workers.py."""
    default = image_task(tmp_path).make_iterator("train", 0, 1, train=True)
    cfg = dataclasses.replace(image_task(tmp_path).cfg, data_workers=2)
    chosen = make_task(cfg, tmp_path).make_iterator("train", 0, 1, train=True)
    assert (default.workers, chosen.workers) == (0, 2)


def shifts(image: np.ndarray, flip: bool) -> list[np.ndarray]:
    """The 9 S x S crops of ``image`` padded by S // 8 = 1 pixel of -1 (mirrored if ``flip``)."""
    padded = np.pad(image, ((1, 1), (1, 1), (0, 0)), constant_values=-1.0)
    crops = [padded[dy:dy + S, dx:dx + S] for dy in range(3) for dx in range(3)]
    return [c[:, ::-1] for c in crops] if flip else crops


@pytest.mark.parametrize("flip", [False, True])
def test_augment_crops_and_flips_training_images_only(tmp_path, flip):
    plain = image_task(tmp_path, seed=4)
    aug = image_task(tmp_path, seed=4, augment=True, flip=flip)
    base, batch = next(plain.train_iterator(0, 1)), next(aug.train_iterator(0, 1))
    np.testing.assert_array_equal(batch["labels"], base["labels"])      # the same seeded order
    train = digits_split("train")
    for img, label in zip(base["images"], base["labels"]):              # rows are train digits
        assert any(np.array_equal(img, x) and label == y
                   for x, y in zip(scaled(train.images), train.labels))
    kinds = []
    for img, src in zip(batch["images"], base["images"]):
        same = [np.array_equal(img, c) for c in shifts(src, False)]
        mirrored = [np.array_equal(img, c) for c in shifts(src, True)] if flip else []
        assert any(same) or any(mirrored)                 # a 1-pixel shift, maybe mirrored
        kinds.append((not same[4], any(mirrored) and not any(same)))
    moved, flipped = np.mean([k[0] for k in kinds]), np.mean([k[1] for k in kinds])
    assert moved > 0.5                                  # 8 of the 9 offsets move the image
    assert (0.2 < flipped < 0.8) if flip else flipped == 0.0      # mirrored with p = 1/2
    # evaluation never augments
    for a, p in zip(aug.eval_batches(0, 1), plain.eval_batches(0, 1)):
        np.testing.assert_array_equal(a["images"], p["images"])


def test_task_sets_the_model_and_rebuilds_from_its_spec(tmp_path):
    task = image_task(tmp_path)
    assert task.model_overrides() == {"num_classes": 10, "num_channels": 1, "image_size": S}
    cfg = task.model_config
    assert (cfg.num_classes, cfg.num_channels, cfg.image_size, cfg.patch_size) == (10, 1, S, 4)
    (images,) = task.init_args()
    assert images.shape == (1, S, S, 1)
    assert task.tokens_per_step() == B * ((S // 4) ** 2 + 1)    # patches + [CLS] per image
    spec = task.spec()
    assert spec == {"dataset": "digits", "num_classes": 10, "num_channels": 1, "max_value": 16.0,
                    "label_names": [str(i) for i in range(10)], "image_size": S, "flip": False}
    assert make_task(task.cfg, tmp_path, spec=spec).info == task.info


def test_a_planned_task_takes_its_shapes_from_the_config_and_opens_no_dataset(tmp_path,
                                                                               monkeypatch):
    """``make_task(plan=True)``, what ``compile`` builds: an image dataset's classes and
    channels are the model config's (the preset's, or ``model.*``), nothing opened, with
    TensorFlow and TFDS unimportable: imagenet2012 in an empty data_dir, an ``hf:`` folder
    that does not exist, CLIP's channels the same way; the digits keep their own facts.
    Unplanned, the same imagenet2012 task reaches for TFDS (the import fails)."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    missing = tmp_path / "nothere"
    cfg = ExperimentConfig(task="image_classification", model="vit", model_preset="tiny",
                           model_overrides={}, dataset="imagenet2012", data_dir=str(missing),
                           batch_size=4)
    task = make_task(cfg, tmp_path / "w", plan=True)
    assert task.model_overrides() == {"num_classes": 10, "num_channels": 3}   # the tiny preset's
    assert {k: (v.shape, str(v.dtype)) for k, v in task.batch_shapes().items()} == {
        "images": ((4, 16, 16, 3), "float32"), "labels": ((4,), "int32"),
        "weights": ((4,), "float32")}
    five = make_task(dataclasses.replace(cfg, dataset=f"hf:{missing}", model_overrides=dict(
        num_classes=5, num_channels=1)), tmp_path / "w", plan=True)
    assert five.info == DatasetInfo(f"hf:{missing}", 5, 1, 255.0, ("0", "1", "2", "3", "4"), True)
    assert (five.model_config.num_classes, five.model_config.num_channels) == (5, 1)
    digits = make_task(dataclasses.replace(cfg, dataset="digits"), tmp_path / "w", plan=True)
    assert digits.saved_spec is None and digits.info == dataset_info("digits")
    clip = make_task(dataclasses.replace(cfg, task="contrastive", model="clip", seq_len=32,
                                         dataset=f"hf:{missing}"), tmp_path / "w", plan=True)
    assert (clip.info.num_classes, clip.info.num_channels, clip.caption_key) == (0, 3, None)
    assert clip.batch_shapes()["images"].shape == (4, 16, 16, 3)
    with pytest.raises(ImportError, match="import of tensorflow_datasets halted"):
        make_task(cfg, tmp_path / "w")
    assert not missing.exists()


# ----------------------------------------------------------------------------- metrics

W = np.random.default_rng(0).normal(size=(S * S, 10)).astype(np.float32)   # (S S pixels, V = 10 classes)


def linear(variables, images, deterministic=True, rngs=None):
    """A stand-in classifier: logits (B, V = 10) = flattened pixels (B, S S) @ W."""
    return images.reshape(images.shape[0], -1) @ variables["params"]["w"]


@pytest.mark.parametrize("eval_batches, count", [(2, 2 * B), (16, 359)])
def test_eval_loss_and_accuracy_match_numpy(tmp_path, eval_batches, count):
    """eval_loss is the mean cross-entropy per image and eval_accuracy the top-1 rate, over the
    first ``eval_batches`` batches' real images (padding rows do not count)."""
    task = image_task(tmp_path)
    task.cfg = task.cfg.replace(eval_batches=eval_batches)
    got = evaluate({"w": W}, linear, task)
    test = digits_split("test")
    logits = scaled(test.images[:count]).reshape(count, -1).astype(np.float64) @ W   # (B = count, V)
    lse = np.log(np.exp(logits).sum(-1))
    labels = test.labels[:count]
    nll = lse - logits[np.arange(count), labels]
    assert got["eval_tokens"] == count
    assert got["eval_loss"] == pytest.approx(nll.mean(), rel=1e-5)
    assert got["eval_accuracy"] == pytest.approx((logits.argmax(-1) == labels).mean(), abs=1e-7)
    assert set(got) == {"eval_loss", "eval_accuracy", "eval_tokens"}   # classes: no perplexity


def test_loss_weights_images_and_defaults_to_all():
    """Per-image cross-entropy (image 0 right, image 1 wrong); a weight-0 image adds nothing
    even with NaN logits; without ``weights`` every image counts."""
    apply = lambda variables, images, deterministic, rngs: variables["params"]  # noqa: E731
    loss_fn = jax.jit(lambda logits, batch: image_classification_loss(apply, logits, batch, None,
                                                                      True, 0.0))
    logits = np.array([[1.0, 0.0], [0.0, 2.0], [np.nan, np.nan]], np.float32)   # (B, V = 2)
    batch = {"images": np.zeros((3, 2, 2, 1), np.float32), "labels": np.array([0, 0, 1], np.int32),
             "weights": np.array([1.0, 1.0, 0.0], np.float32)}
    want = math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2))
    loss, sums = loss_fn(logits, batch)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(sums["weight"]) == 2 and float(sums["correct"]) == 1
    logits[2] = [3.0, 0.0]                                            # wrong, ln(1 + e^3)
    loss, sums = loss_fn(logits, {k: v for k, v in batch.items() if k != "weights"})
    assert float(sums["weight"]) == 3 and float(sums["correct"]) == 1
    assert float(loss) == pytest.approx(want + math.log(1 + math.exp(3)), rel=1e-6)


def test_sample_lists_predictions_against_labels(tmp_path):
    class AlwaysThree:
        def apply(self, variables, images):
            return jnp.zeros((images.shape[0], 10)).at[:, 3].set(1.0)

    text = image_task(tmp_path, num_samples=5).sample(AlwaysThree(), {}, step=0)
    labels = digits_split("test").labels[:5]
    assert text == "prediction/label (* = wrong): " + " ".join(
        f"3/{y}" + ("" if y == 3 else "*") for y in labels)
    assert image_task(tmp_path, num_samples=0).sample(AlwaysThree(), {}, step=0) is None
