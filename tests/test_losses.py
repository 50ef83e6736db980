"""Tests for transformer_jax.losses: label-smoothed cross-entropy (golden values and torch
parity), sums that combine over micro-batches, the token loss's sums and their means."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import losses

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------
# Label-smoothed cross-entropy
# ---------------------------------------------------------------------------


def test_label_smoothing_hand_computed():
    # One token, V = 3, logits log([1, 2, 1]) -> p = [0.25, 0.5, 0.25].
    logits = jnp.log(jnp.array([[[1.0, 2.0, 1.0]]]))
    targets = jnp.array([[1]])
    eps = 0.1
    # loss = (1-eps) * -log 0.5 + eps * mean(-log p)
    #      = 0.9 * ln 2 + 0.1 * (ln 4 + ln 2 + ln 4) / 3 = (0.9 + 0.1 * 5 / 3) ln 2
    want = (0.9 + 0.5 / 3) * math.log(2.0)
    loss_sum, weight_sum = losses.label_smoothed_cross_entropy(logits, targets, smoothing=eps)
    assert float(loss_sum) == pytest.approx(want, rel=1e-6)
    assert float(weight_sum) == 1.0
    plain, _ = losses.label_smoothed_cross_entropy(logits, targets)
    assert float(plain) == pytest.approx(math.log(2.0), rel=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_label_smoothing_matches_torch(dtype):
    rng = np.random.default_rng(1)
    b, t, v = 3, 5, 11
    logits = (rng.normal(size=(b, t, v)) * 3).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    targets[0, 3:] = -100  # padding, ignored by torch via ignore_index
    targets[2, 1] = -100
    weights = targets != -100

    logits_j = jnp.asarray(logits, dtype)
    # torch sees exactly the values the JAX loss sees (after the fp32 upcast).
    logits_t = torch.tensor(np.asarray(logits_j.astype(jnp.float32)))
    want = torch.nn.functional.cross_entropy(
        logits_t.reshape(-1, v), torch.tensor(targets).reshape(-1),
        ignore_index=-100, label_smoothing=0.1,
    ).item()
    loss_sum, weight_sum = losses.label_smoothed_cross_entropy(
        logits_j, jnp.asarray(targets), jnp.asarray(weights), smoothing=0.1
    )
    assert loss_sum.dtype == jnp.float32
    assert float(weight_sum) == weights.sum()
    assert float(losses.mean_loss(loss_sum, weight_sum)) == pytest.approx(want, abs=1e-6)


def test_loss_sums_combine_exactly_over_microbatches():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 6, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, size=(4, 6)))
    weights = jnp.asarray(rng.integers(0, 2, size=(4, 6)))
    full = losses.label_smoothed_cross_entropy(logits, targets, weights, 0.2)
    parts = [
        losses.label_smoothed_cross_entropy(logits[i:i + 1], targets[i:i + 1],
                                           weights[i:i + 1], 0.2)
        for i in range(4)
    ]
    loss = sum(p[0] for p in parts)
    count = sum(p[1] for p in parts)
    assert float(losses.mean_loss(loss, count)) == pytest.approx(
        float(losses.mean_loss(*full)), rel=1e-6
    )
    assert float(losses.mean_loss(jnp.float32(0.0), jnp.float32(0.0))) == 0.0


def test_loss_gradient_is_finite_with_masked_infinities():
    logits = jnp.array([[[0.0, 1.0], [-jnp.inf, 0.0]]])
    targets = jnp.array([[1, 0]])
    weights = jnp.array([[1.0, 0.0]])

    def f(x):
        return losses.mean_loss(*losses.label_smoothed_cross_entropy(x, targets, weights, 0.1))

    value, grad = jax.value_and_grad(f)(logits)
    assert np.isfinite(float(value))
    assert np.all(np.isfinite(np.asarray(grad[0, 0])))


def test_token_loss_sums_golden():
    """loss/nll/weight/correct sums by hand: hits are targets holding the row maximum (a tie
    for the top counts), weights 0 drop a position whatever its target (-100 included)."""
    logits = jnp.array([[[2.0, 0.0, 0.0],      # target 0: hit
                         [0.0, 1.0, 3.0],      # target 1: miss
                         [1.0, 1.0, 0.0],      # target 1: tie for the top -> hit
                         [5.0, 0.0, 0.0]]])    # weight 0, target -100
    targets = jnp.array([[0, 1, 1, -100]])
    weights = jnp.array([[1.0, 2.0, 1.0, 0.0]])
    loss_sum, sums = losses.token_loss(logits, targets, weights, 0.0)
    lse = np.log(np.exp(np.asarray(logits[0, :3])).sum(-1))
    nll = lse - np.array([2.0, 1.0, 1.0])
    np.testing.assert_allclose(loss_sum, nll @ np.array([1.0, 2.0, 1.0]), rtol=1e-6)
    np.testing.assert_allclose(sums["nll"], loss_sum, rtol=1e-6)
    assert float(sums["weight"]) == 4.0 and float(sums["correct"]) == 2.0
    # an out-of-range target is never a hit, even where every logit is below zero
    _, sums = losses.token_loss(-jnp.ones((1, 2, 3)), jnp.array([[-100, 7]]), jnp.ones((1, 2)), 0.0)
    assert float(sums["correct"]) == 0.0


def test_per_weight_means_golden():
    """loss and every named sum divided by the weight; correct is reported as accuracy."""
    sums = {"weight": jnp.float32(4.0), "nll": jnp.float32(6.0), "correct": jnp.float32(3.0)}
    got = {k: float(v) for k, v in losses.per_weight_means(jnp.float32(10.0), sums).items()}
    assert got == {"loss": 2.5, "nll": 1.5, "accuracy": 0.75}
    empty = losses.per_weight_means(jnp.float32(0.0), {"weight": jnp.float32(0.0)})
    assert float(empty["loss"]) == 0.0


def test_lm_loss_is_the_token_loss_of_the_model_logits():
    """lm_loss feeds the model's logits for ``inputs`` to token_loss with targets/weights."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 5)), jnp.float32)
    batch = {"inputs": jnp.zeros((2, 3), jnp.int32), "targets": jnp.array([[1, 2, 3], [4, 0, 1]]),
             "weights": jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])}
    apply_fn = lambda variables, ids, deterministic, rngs: logits  # noqa: E731
    got_sum, got = losses.lm_loss(apply_fn, {}, batch, None, True, 0.1)
    want_sum, want = losses.token_loss(logits, batch["targets"], batch["weights"], 0.1)
    assert float(got_sum) == float(want_sum) and float(got["weight"]) == 5.0
    assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}


# ---------------------------------------------------------------------------
# Chunked read-out + cross-entropy
# ---------------------------------------------------------------------------

def _readout_case(n_rows=3, t=7, d=8, v=13):
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    hidden = jax.random.normal(ks[0], (n_rows, t, d))
    kernel = jax.random.normal(ks[1], (d, v)) * 0.7
    bias = jax.random.normal(ks[2], (v,))
    table = jax.random.normal(ks[3], (v, d)) * 0.7             # a tied embedding (V, D)
    targets = jax.random.randint(ks[4], (n_rows, t), 0, v)
    weights = (jax.random.uniform(ks[5], (n_rows, t)) > 0.3).astype(jnp.float32) * 1.5
    targets = targets.at[0, 2].set(-100).at[1, 4].set(v + 5)   # out of range, at weight 0
    weights = weights.at[0, 2].set(0.0).at[1, 4].set(0.0).at[2, 0].set(2.0)
    return hidden, kernel, bias, table, targets, weights


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("chunk", [4, 64])    # 4 does not divide the rows' 7 positions; 64 > 7
def test_chunked_cross_entropy_equals_plain_loss_and_gradients(tied, smoothing, softcap, chunk):
    hidden, kernel, bias, table, targets, weights = _readout_case()

    def read(hidden, kernel, bias, table):
        w = table.T if tied else kernel
        return w, (None if tied else bias)

    def plain(hidden, kernel, bias, table):
        w, b = read(hidden, kernel, bias, table)
        logits = jnp.dot(hidden, w, precision="highest")
        logits = logits if b is None else logits + b
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        return losses.token_loss(logits, targets, weights, smoothing)

    def chunked(hidden, kernel, bias, table):
        w, b = read(hidden, kernel, bias, table)
        return losses.chunked_cross_entropy(hidden, w, targets, weights, smoothing, bias=b,
                                            softcap=softcap, chunk=chunk, precision="highest")

    args = (hidden, kernel, bias, table)
    (want, want_sums), want_g = jax.value_and_grad(plain, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    (got, got_sums), got_g = jax.value_and_grad(chunked, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert set(got_sums) == {"weight", "nll", "correct"}
    assert float(got_sums["weight"]) == float(want_sums["weight"]) == float(jnp.sum(weights))
    assert float(got_sums["nll"]) == pytest.approx(float(want_sums["nll"]), rel=1e-6)
    assert float(got_sums["correct"]) == float(want_sums["correct"])
    for name, g, w in zip(("hidden", "kernel", "bias", "table"), got_g, want_g):
        if float(jnp.max(jnp.abs(w))) == 0.0:          # the unused one of kernel / table
            assert float(jnp.max(jnp.abs(g))) == 0.0, name
        else:
            assert _rel(g, w) < 1e-6, name


def test_chunked_cross_entropy_hits_are_the_argmax_hits():
    # logits = hidden @ I: token 0's top logit is its target, token 1's is not
    hidden = jnp.array([[0.0, 3.0, 1.0], [2.0, 0.5, 0.1]])
    targets = jnp.array([1, 2])
    _, sums = losses.chunked_cross_entropy(hidden, jnp.eye(3), targets, chunk=1)
    assert float(sums["correct"]) == 1.0
    lse = jax.nn.logsumexp(hidden, axis=-1)
    assert float(sums["nll"]) == pytest.approx(float(lse[0] - 3.0 + lse[1] - 0.1), rel=1e-6)


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_chunked_cross_entropy_refuses_a_bad_chunk(chunk):
    with pytest.raises(losses.UserError, match=r"loss_chunk=.* must be a positive int"):
        losses.chunked_cross_entropy(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(2, jnp.int32),
                                     chunk=chunk)


def test_chunked_loss_never_holds_the_whole_logits():
    """Compiled (XLA:CPU) loss + gradients at N x V = 8192 x 4096 (128 MiB of float32
    logits): the plain loss's temporaries hold them whole (at least 128 MiB); the chunked
    one's (chunks of 256 positions of its one row: 4 MiB of logits) stay under a tenth of
    that (4.5 MiB)."""
    n, d, v = 8192, 32, 4096
    logits_bytes = n * v * 4
    hidden = jax.ShapeDtypeStruct((n, d), jnp.float32)
    kernel = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((n,), jnp.int32)

    def plain(h, w, t):
        return losses.token_loss(h @ w, t, None, 0.1)[0]

    def chunked(h, w, t):
        return losses.chunked_cross_entropy(h, w, t, None, 0.1, chunk=256)[0]

    def temp_bytes(f):
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(hidden, kernel, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(plain) >= logits_bytes
    assert temp_bytes(chunked) < logits_bytes / 10
