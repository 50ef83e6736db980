"""``data.shuffle``: the per-epoch order as a keyed bijection looked up per index
(``shuffled``), and the fixed hash order the digits split keeps."""
import numpy as np
import pytest

from transformer_jax.data.shuffle import hash_order, permutation, shuffled

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 1000, 2**16 + 3])
def test_it_is_a_bijection_and_lookups_agree_with_the_whole(n):
    for seed, epoch in ((0, 0), (3, 1), (2**40 + 5, 7)):
        order = permutation(n, seed, epoch)
        assert order.dtype == np.int64 and order.shape == (n,)
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
        positions = np.array([[0, n - 1], [n // 2, n // 3]])
        np.testing.assert_array_equal(shuffled(positions, n, seed, epoch), order[positions])


def test_it_differs_between_epochs_and_seeds():
    orders = {tuple(permutation(50, seed, epoch)) for seed in range(10) for epoch in range(10)}
    assert len(orders) == 100
    assert not np.array_equal(permutation(1000, 0, 0), np.arange(1000))


def test_it_is_roughly_uniform():
    # Each element's position over 4000 seeds: every (element, position) pair about
    # 4000/8 = 500 times (binomial sd 21).
    n, seeds = 8, 4000
    counts = np.zeros((n, n))
    for seed in range(seeds):
        counts[permutation(n, seed, 0), np.arange(n)] += 1
    assert np.abs(counts - seeds / n).max() < 100
    # The mean position of each of 1000 elements over 200 seeds: (n-1)/2 with the sd of a
    # uniform position, sqrt((n^2-1)/12/200) = 20.4.
    n, seeds = 1000, 200
    mean = np.zeros(n)
    for seed in range(seeds):
        mean[permutation(n, seed, 1)] += np.arange(n) / seeds
    assert abs(mean.mean() - (n - 1) / 2) < 1e-9
    assert 16 < mean.std() < 25 and np.abs(mean - (n - 1) / 2).max() < 110


def test_a_huge_split_is_looked_up_without_materialising_it():
    n = 30_000_000                                      # lm1b's sentences
    items = shuffled(np.arange(4096), n, seed=1, epoch=2)
    assert len(set(items.tolist())) == 4096 and 0 <= items.min() and items.max() < n
    np.testing.assert_array_equal(shuffled(np.arange(4096), n, 1, 2), items)   # a function
    with pytest.raises(ValueError, match="positions must lie in"):
        shuffled([n], n, 1, 2)


def test_the_hash_order_is_fixed():
    # The digits split's partition: the stable argsort of SplitMix64 hashes, pinned.
    assert hash_order(8, 0).tolist() == [4, 0, 1, 7, 6, 2, 5, 3]
    assert hash_order(8, 1).tolist() == [3, 5, 2, 4, 1, 0, 6, 7]
