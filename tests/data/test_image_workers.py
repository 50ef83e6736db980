"""Image batches made in worker processes equal the in-process ones, resume exactly, and
each augmentation is a function of (seed, epoch, index) only."""
import numpy as np
import pytest

from transformer_jax.data.image_workers import host_cores
from transformer_jax.data.images import (ArraySource, ImageIterator, default_workers,
                                         prepare_row, preprocess_image)
from transformer_jax.errors import UserError

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

SEED = 3


def _source(n=23, channels=3):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 20, 26, channels)).astype(np.uint8)
    return ArraySource(images, np.arange(n, dtype=np.int32) % 7)


def _annotate(example, index, epoch):
    """Uses only what a worker hands back (no image): label, index, epoch."""
    return {"tag": np.array([int(example["label"]), index, epoch], np.int32)}


def _iterator(source, workers, *, batch_size=6, repeat=True, process_index=0,
              process_count=1):
    return ImageIterator(source, name="t", split="train", image_size=12, num_channels=3,
                         max_value=255.0, batch_size=batch_size, seed=SEED, shuffle=repeat,
                         repeat=repeat, augment=repeat, flip=True, annotate=_annotate,
                         process_index=process_index, process_count=process_count,
                         workers=workers)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w) == ["images", "labels", "tag", "weights"]
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_workers_make_the_in_process_batches_across_epochs_and_resume_exactly():
    source = _source()
    want = _take(_iterator(source, 0), 9)        # 3 batches per epoch: epochs 0, 1, 2
    it = _iterator(source, 2)
    try:
        _assert_same(_take(it, 5), want[:5])
        assert it.get_state() == {"mode": "images", "epoch": 1, "index": 2}
        it.set_state({"mode": "images", "epoch": 0, "index": 1})   # queued batches dropped
        _assert_same(_take(it, 3), want[1:4])
    finally:
        it.close()
    resumed = _iterator(source, 2)               # a fresh run resumed mid-epoch
    try:
        resumed.set_state({"mode": "images", "epoch": 1, "index": 1})
        _assert_same(_take(resumed, 4), want[4:8])
    finally:
        resumed.close()
    assert _iterator(source, 0).get_state() == _iterator(source, 2).get_state()


def test_workers_make_the_padded_eval_batches_of_each_process():
    source = _source(n=11)
    for p in range(2):
        want = list(_iterator(source, 0, batch_size=4, repeat=False, process_index=p,
                              process_count=2))
        it = _iterator(source, 1, batch_size=4, repeat=False, process_index=p, process_count=2)
        got = list(it)
        it.close()
        _assert_same(got, want)
        assert [float(b["weights"].sum()) for b in got] == ([2, 2, 2] if p == 0 else [2, 2, 1])


@pytest.mark.parametrize("batch_size,workers", [(5, 2), (8, 1)])
def test_augmentation_is_a_function_of_seed_epoch_and_index(batch_size, workers):
    source = _source()
    it = _iterator(source, workers, batch_size=batch_size)
    try:
        batches = _take(it, 23 // batch_size + 1)   # into epoch 1
    finally:
        it.close()
    checked = set()
    for batch in batches:
        for row in range(batch_size):
            label, index, epoch = (int(v) for v in batch["tag"][row])
            rng = np.random.default_rng([SEED, epoch, index])
            want = preprocess_image(source[index]["image"], 12, augment=True, flip=True,
                                    rng=rng)
            np.testing.assert_array_equal(batch["images"][row], want)
            assert label == int(source.labels[index])
            checked.add((epoch, index))
    assert {e for e, _ in checked} == {0, 1}


def test_prepare_row_is_preprocess_image_with_the_example_rng():
    source = _source()
    params = {"seed": SEED, "image_size": 12, "max_value": 255.0, "augment": True,
              "flip": True, "num_channels": 3, "name": "t"}
    got = prepare_row(source[4], 4, 2, params)
    want = preprocess_image(source[4]["image"], 12, augment=True, flip=True,
                            rng=np.random.default_rng([SEED, 2, 4]))
    np.testing.assert_array_equal(got, want)
    crops = {prepare_row(source[4], 4, epoch, params).tobytes() for epoch in range(6)}
    assert len(crops) > 1                                # the epoch draws another crop


def test_a_worker_error_reaches_the_caller():
    source = _source(channels=1)
    it = ImageIterator(source, name="gray", split="train", image_size=12, num_channels=3,
                       max_value=255.0, batch_size=4, seed=0, shuffle=False, repeat=True,
                       workers=1)
    try:
        with pytest.raises(UserError, match=r"^dataset 'gray' example 0 has 1 channels, "
                                            r"expected 3$"):
            next(it)
    finally:
        it.close()


def test_default_workers_keeps_arrays_in_process_and_decodes_elsewhere_on_every_core():
    class Encoded:   # any source other than decoded arrays in memory
        def __len__(self):
            return 1

    assert default_workers(_source()) == 0
    assert default_workers(Encoded()) == host_cores() >= 1
    assert default_workers(_source(), 3) == 3 and default_workers(Encoded(), 0) == 0
    with pytest.raises(UserError, match="data_workers must be an integer >= 0"):
        _iterator(_source(), -1)


def test_a_source_that_cannot_reach_the_workers_is_a_user_error_naming_the_fix():
    class Local(ArraySource):   # a class defined in a function does not pickle
        pass

    source = _source()
    it = _iterator(Local(source.images, source.labels), 1)
    with pytest.raises(UserError, match=r"^the 't' image source \(Local\) cannot be sent to "
                                        r"worker processes \(.*\); set data_workers=0 to "
                                        r"preprocess in the training process$"):
        next(it)


def test_background_thread_over_workers_resumes_exactly():
    """What training runs: Background (its producer thread ahead) over the worker pool; the
    state after 4 batches, restored into a fresh one, continues with batch 5."""
    from transformer_jax.data.background import Background

    source = _source()
    want = _take(_iterator(source, 0), 7)
    first = Background(_iterator(source, 2), depth=2)
    _assert_same(_take(first, 4), want[:4])
    state = first.get_state()
    first.close()
    first.iterator.close()
    assert state == {"mode": "images", "epoch": 1, "index": 1}
    resumed = Background(_iterator(source, 2), depth=2)
    resumed.set_state(state)
    try:
        _assert_same(_take(resumed, 3), want[4:7])
    finally:
        resumed.close()
        resumed.iterator.close()
