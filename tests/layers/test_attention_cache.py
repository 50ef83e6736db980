"""MultiHeadAttention's three decode caches as the pure functions they are: the
self-attention KV cache, the ring of a sliding window, linear attention's state. Small
integer-valued keys, so every slot and mask entry is checked by value; the decode-equals-
the-full-pass tests of the module are in test_attention.py and test_efficient_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers.masks import AttentionPattern
from transformer_jax.layers.multi_head import (linear_cache_update, ring_cache_update,
                                               self_cache_update)


def positions_kv(first: int, t: int, kh: int = 2, h: int = 3):
    """k, v (1, T, K, H) whose every entry for position p is p (keys) and -p (values)."""
    p = jnp.arange(first, first + t, dtype=jnp.float32)[None, :, None, None]
    k = jnp.broadcast_to(p, (1, t, kh, h))
    return k, -k


def slots(cache):
    """The position held in each slot of a (1, K, S, H) cache (its first entry)."""
    return np.asarray(cache[0, 0, :, 0]).tolist()


# ----------------------------------------------------------------------------- self cache

@pytest.mark.parametrize("causal", [True, False])
def test_self_cache_at_index_i_writes_position_i_and_the_mask_covers_0_to_i(causal):
    s_max = 6
    ck = cv = jnp.full((1, 2, s_max, 3), -7.0)                 # -7: never written
    ck, cv, _, _, _ = self_cache_update(ck, cv, jnp.array(0), *positions_kv(0, 3),
                                        causal=causal)       # a prefill of 3 positions
    k, v = positions_kv(3, 1)                                 # then position 3, alone
    ck, cv, keys, values, mask = self_cache_update(ck, cv, jnp.array(3), k, v, causal=causal)
    assert slots(ck) == [0, 1, 2, 3, -7, -7]
    assert slots(cv) == [0, -1, -2, -3, -7, -7]
    assert ck.shape == (1, 2, s_max, 3) and keys.shape == values.shape == (1, s_max, 2, 3)
    np.testing.assert_array_equal(keys, jnp.swapaxes(ck, 1, 2))
    np.testing.assert_array_equal(values, jnp.swapaxes(cv, 1, 2))
    assert mask.shape == (1, 1, 1, s_max)
    assert np.asarray(mask[0, 0, 0]).tolist() == [True] * 4 + [False] * 2


def test_self_cache_mask_of_a_block_of_queries_is_causal_at_its_offset():
    ck = cv = jnp.zeros((1, 2, 6, 3))
    *_, causal = self_cache_update(ck, cv, jnp.array(2), *positions_kv(2, 2), causal=True)
    *_, full = self_cache_update(ck, cv, jnp.array(2), *positions_kv(2, 2), causal=False)
    assert np.asarray(causal[0, 0], int).tolist() == [[1, 1, 1, 0, 0, 0],    # position 2
                                                      [1, 1, 1, 1, 0, 0]]    # position 3
    assert full.shape == (1, 1, 1, 6)                        # one row for both queries
    assert np.asarray(full[0, 0, 0], int).tolist() == [1, 1, 1, 1, 0, 0]


def test_self_cache_mask_holds_a_sparse_pattern_in_absolute_positions():
    ck = cv = jnp.zeros((1, 2, 8, 3))
    pattern = AttentionPattern("strided", 2)              # the last 2 and every 2nd before
    *_, mask = self_cache_update(ck, cv, jnp.array(6), *positions_kv(6, 1), causal=True,
                                 pattern=pattern)
    assert np.asarray(mask[0, 0, 0], int).tolist() == [1, 0, 1, 0, 1, 1, 1, 0]
    np.testing.assert_array_equal(mask[0, 0, 0], pattern.mask(8, causal=True)[0, 0, 6])


# ----------------------------------------------------------------------------- ring

def test_ring_keeps_the_last_w_keys_each_in_slot_position_mod_w():
    w = 3
    ck = cv = jnp.full((1, 2, w, 3), -7.0)
    for i in range(7):                                        # positions 0 .. 6, one a call
        ck, cv, keys, values, mask = ring_cache_update(ck, cv, jnp.array(i), *positions_kv(i, 1))
        seen = {int(p) for p, ok in zip(keys[0, :, 0, 0], mask[0, 0, 0]) if ok}
        assert seen == set(range(max(0, i - w + 1), i + 1))   # the W latest, itself included
    assert slots(ck) == [6, 4, 5] and slots(cv) == [-6, -4, -5]


def test_ring_keys_and_mask_at_one_step():
    """At index 7 (W = 3) the ring holds 6, 4, 5; the new key 7 follows. Position 7 sees
    5, 6 and itself; 4 is W before it."""
    ck = cv = jnp.array([6.0, 4.0, 5.0])[None, None, :, None] * jnp.ones((1, 2, 3, 3))
    cv = -cv
    ck2, _, keys, values, mask = ring_cache_update(ck, cv, jnp.array(7), *positions_kv(7, 1))
    assert np.asarray(keys[0, :, 0, 0]).tolist() == [6, 4, 5, 7]
    assert np.asarray(values[0, :, 1, 2]).tolist() == [-6, -4, -5, -7]
    assert mask.shape == (1, 1, 1, 4)
    assert np.asarray(mask[0, 0, 0]).tolist() == [True, False, True, True]
    assert slots(ck2) == [6, 7, 5]                            # 7 mod 3 = 1 replaces 4


def test_ring_before_it_is_full_and_a_prefill_longer_than_w():
    w = 3
    empty = jnp.full((1, 2, w, 3), -7.0)
    ck, _, keys, _, mask = ring_cache_update(empty, empty, jnp.array(0), *positions_kv(0, 5))
    assert slots(ck) == [3, 4, 2]                             # only the newest W: 2, 3, 4
    assert np.asarray(mask[0, 0], int).tolist() == [          # keys: 3 empty slots, 0 .. 4
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1]]
    ck, _, _, _, mask = ring_cache_update(empty, empty, jnp.array(1), *positions_kv(1, 1))
    assert np.asarray(mask[0, 0, 0]).tolist() == [True, False, False, True]   # slot 0 = 0


def test_ring_reads_a_padding_mask_at_the_keys_absolute_positions():
    s_max = 10
    ck = jnp.array([6.0, 4.0, 5.0])[None, None, :, None] * jnp.ones((1, 2, 3, 3))
    padding = (jnp.arange(s_max) != 5)[None, None, None, :]  # position 5 is padding
    *_, mask = ring_cache_update(ck, ck, jnp.array(7), *positions_kv(7, 1), mask=padding)
    assert np.asarray(mask[0, 0, 0]).tolist() == [True, False, False, True]


# ----------------------------------------------------------------------------- linear state

def phi(x):
    return np.where(x > 0, x + 1.0, np.exp(x))               # elu + 1


def test_linear_state_after_n_steps_is_the_sum_of_phi_k_v():
    b, n, kh, h, hv, steps = 2, 4, 2, 3, 5, 6
    rng = np.random.default_rng(0)
    q = rng.normal(size=(b, steps, n, h)).astype(np.float32)
    k = rng.normal(size=(b, steps, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, steps, kh, hv)).astype(np.float32)
    state, norm = jnp.zeros((b, kh, h, hv)), jnp.zeros((b, kh, h))
    outs = []
    for i in range(steps):
        out, state, norm = linear_cache_update(state, norm, jnp.array(i), q[:, i:i + 1],
                                               k[:, i:i + 1], v[:, i:i + 1])
        outs.append(out)
    want_state = np.einsum("bskh,bskv->bkhv", phi(k), v)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(norm, phi(k).sum(axis=1), rtol=1e-5, atol=1e-5)
    # the output of the last step: phi(q) state / (phi(q) . norm), query heads grouped by 2
    qf = phi(q[:, -1]).reshape(b, kh, n // kh, h)
    want = (np.einsum("bkgh,bkhv->bkgv", qf, want_state)
            / (np.einsum("bkgh,bkh->bkg", qf, phi(k).sum(axis=1))[..., None] + 1e-6))
    np.testing.assert_allclose(outs[-1][:, 0], want.reshape(b, n, hv), rtol=1e-5, atol=1e-5)


def test_linear_state_skips_the_keys_the_padding_mask_drops():
    b, kh, h, hv, steps = 2, 1, 2, 2, 4
    rng = np.random.default_rng(1)
    k = rng.normal(size=(b, steps, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, steps, kh, hv)).astype(np.float32)
    valid = jnp.array([[True] * 4, [False, False, True, True]])     # row 1: left padding 2
    state, norm = jnp.zeros((b, kh, h, hv)), jnp.zeros((b, kh, h))
    _, state, norm = linear_cache_update(state, norm, jnp.array(0), k[:, :3], k[:, :3],
                                         v[:, :3], mask=valid[:, None, None, :])   # prefill 3
    _, state, norm = linear_cache_update(state, norm, jnp.array(3), k[:, 3:], k[:, 3:],
                                         v[:, 3:], mask=valid[:, None, None, :])
    keep = np.asarray(valid, np.float32)[:, :, None, None]
    np.testing.assert_allclose(state, np.einsum("bskh,bskv->bkhv", phi(k) * keep, v),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm, (phi(k) * keep).sum(axis=1), rtol=1e-5, atol=1e-6)
    assert jax.tree.map(jnp.shape, (state, norm)) == ((b, kh, h, hv), (b, kh, h))
