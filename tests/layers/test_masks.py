"""Golden values for the mask functions (1 = may attend)."""
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import (causal_mask, combine_masks, key_padding_mask,
                                    padding_mask_from_ids, padding_mask_from_lengths,
                                    query_key_mask, sliding_window_mask)


def test_causal_mask_golden():
    np.testing.assert_array_equal(causal_mask(4)[0, 0].astype(int),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    # two new queries after 3 cached keys (KV-cache decoding), 6 cache slots
    np.testing.assert_array_equal(causal_mask(2, 6, offset=3)[0, 0].astype(int),
                                  [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])


def test_sliding_window_golden():
    np.testing.assert_array_equal(sliding_window_mask(5, window=2)[0, 0].astype(int),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                   [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(sliding_window_mask(4, window=2, causal=False)[0, 0].astype(int),
                                  [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(4, window=0)


def test_padding_masks_golden():
    m = padding_mask_from_lengths(jnp.array([2, 4]), 4)
    assert m.shape == (2, 1, 1, 4)
    np.testing.assert_array_equal(m[:, 0, 0].astype(int), [[1, 1, 0, 0], [1, 1, 1, 1]])
    ids = jnp.array([[5, 7, 0, 0], [3, 0, 9, 1]])
    np.testing.assert_array_equal(padding_mask_from_ids(ids, pad_id=0)[:, 0, 0].astype(int),
                                  [[1, 1, 0, 0], [1, 0, 1, 1]])
    np.testing.assert_array_equal(key_padding_mask(ids != 0), padding_mask_from_ids(ids))
    qk = query_key_mask(jnp.array([[1, 0]]), jnp.array([[1, 1, 0]]))
    np.testing.assert_array_equal(qk[0, 0].astype(int), [[1, 1, 0], [0, 0, 0]])
    both = combine_masks(causal_mask(4), padding_mask_from_lengths(jnp.array([3]), 4))
    np.testing.assert_array_equal(both[0, 0].astype(int),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    assert combine_masks(None, None) is None
    with pytest.raises(ValueError, match="2-D"):
        padding_mask_from_ids(jnp.zeros((2, 3, 4), jnp.int32))
