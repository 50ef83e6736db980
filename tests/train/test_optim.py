"""Tests for transformer_jax.train.optim: schedules, decay mask, AdamW."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.train import optim

torch = pytest.importorskip("torch")


def _values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps], dtype=np.float64)


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------


def _noam_reference(step, d_model, warmup, scale=1.0):
    s = max(step, 1)
    return scale * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)


@pytest.mark.parametrize("d_model,warmup,scale", [(64, 4000, 1.0), (512, 10, 2.0)])
def test_noam_matches_reference_formula(d_model, warmup, scale):
    steps = [0, 1, 2, 5, warmup - 1, warmup, warmup + 1, 2 * warmup, 100_000]
    steps += [100, 4000, 8000]
    got = _values(optim.noam(d_model, warmup, scale), steps)
    want = np.array([_noam_reference(s, d_model, warmup, scale) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_noam_known_values():
    sched = optim.noam(64, 4000)
    # lr(0) == lr(1) because of max(step, 1); both are 0.125 * 4000**-1.5.
    assert float(sched(0)) == pytest.approx(4.9410588e-07, rel=1e-6)
    assert float(sched(1)) == pytest.approx(4.9410588e-07, rel=1e-6)
    assert float(sched(100)) == pytest.approx(4.9410588e-05, rel=1e-6)
    assert float(sched(4000)) == pytest.approx(1.9764235e-03, rel=1e-6)
    assert float(sched(8000)) == pytest.approx(1.3975425e-03, rel=1e-6)


def test_noam_warmup_one_and_jit():
    sched = optim.noam(16, 1)
    want = [_noam_reference(s, 16, 1) for s in (0, 1, 4, 9)]
    np.testing.assert_allclose(_values(sched, (0, 1, 4, 9)), want, rtol=1e-6)
    # Schedules are traced inside optax's jitted update; check under jit too.
    jitted = jax.jit(optim.noam(64, 4000))
    assert float(jitted(jnp.int32(8000))) == pytest.approx(0.0013975425, rel=1e-6)


def test_warmup_cosine_closed_form():
    peak, warm, total, end, init = 1e-3, 10, 110, 1e-5, 1e-4
    sched = optim.warmup_cosine(peak, warm, total, end_lr=end, init_lr=init)

    def ref(step):
        if step < warm:
            return init + (peak - init) * step / warm
        t = min(step - warm, total - warm) / (total - warm)
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))

    steps = [0, 1, 5, 9, 10, 11, 35, 60, 85, 109, 110, 111, 10_000]
    np.testing.assert_allclose(
        _values(sched, steps), [ref(s) for s in steps], rtol=1e-5, atol=1e-10
    )
    # Spot values: peak at the end of warm-up, midpoint of the cosine, end.
    assert float(sched(10)) == pytest.approx(1e-3, rel=1e-6)
    assert float(sched(60)) == pytest.approx((1e-3 + 1e-5) / 2, rel=1e-5)
    assert float(sched(500)) == pytest.approx(1e-5, rel=1e-5)


def test_warmup_cosine_without_warmup_starts_at_peak():
    sched = optim.warmup_cosine(2.0, 0, 4)
    np.testing.assert_allclose(
        _values(sched, [0, 1, 2, 3, 4, 5]),
        [2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4), 0, 0],
        rtol=1e-6,
        atol=1e-7,
    )


def _lambda_lr_rates(base_lr, lr_lambda, updates):
    """The rate of each update under ``torch.optim.lr_scheduler.LambdaLR``, stepped as the
    seeds do: ``opt.step(); sched.step()``."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=base_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lr_lambda)
    rates = []
    for _ in range(updates):
        rates.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
    return np.array(rates)


def _relative(got, want):
    scale = np.maximum(np.abs(got), np.abs(want))
    return np.where(scale > 0, np.abs(got - want) / np.where(scale > 0, scale, 1.0), 0.0)


def test_noam_equals_the_seeds_lambda_lr():
    """The seed's noam_lr under LambdaLR(AdamW(lr=1.0)): every update's rate over 9,000 updates,
    and the four values the seed prints for d_model 64."""
    def noam_lr(step, d_model=512, warmup=4000):
        step = max(step, 1)
        return (d_model ** -0.5) * min(step ** -0.5, step * warmup ** -1.5)

    want = _lambda_lr_rates(1.0, lambda s: noam_lr(s, d_model=64), 9000)
    got = _values(optim.noam(64, 4000), range(9000))
    assert _relative(got, want).max() < 1e-6
    assert [round(float(optim.noam(64, 4000)(s)), 5) for s in [1, 100, 4000, 8000]] == \
        [0.0, 5e-05, 0.00198, 0.0014]


@pytest.mark.parametrize("warmup,total", [(5, 30), (100, 1000), (0, 40)])
def test_warmup_times_cosine_equals_the_seeds_lambda_lr(warmup, total):
    """The seeds' linear warm-up times a cosine over the whole run, under LambdaLR: equal at
    every update, including the last ones where the rate nears 0; held at 0 after the run."""
    def lr_lambda(step):
        ramp = min(step / warmup, 1.0) if warmup else 1.0
        return ramp * (0.5 * (1 + math.cos(math.pi * step / total)))

    peak = 3e-3
    want = _lambda_lr_rates(peak, lr_lambda, total)
    sched = optim.make_schedule("warmup_times_cosine", peak_lr=peak, warmup_steps=warmup,
                                total_steps=total)
    got = _values(sched, range(total))
    assert _relative(got, want).max() < 1e-6
    assert got[-1] > 0 and float(sched(total)) == 0.0 and float(sched(total + 7)) == 0.0
    # not warmup_cosine: its cosine starts after the warm-up (a higher rate mid-run)
    if warmup:
        other = _values(optim.warmup_cosine(peak, warmup, total), range(total))
        assert other[total // 2] > got[total // 2] * 1.05


def test_warmup_cosine_keeps_relative_precision_at_the_end():
    """A 30-step run's last rates are ~1e-3 of the peak; float32 1 + cos(x) near x = pi would
    be off by ~1e-5 relative there. The schedule is within 1e-6 of float64 at every step."""
    peak, warmup, total = 2e-3, 5, 30
    got = _values(optim.warmup_cosine(peak, warmup, total), range(total))
    want = [peak * s / warmup if s < warmup else
            peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
            for s in range(total)]
    assert _relative(got, np.array(want)).max() < 1e-6


@pytest.mark.parametrize("name,kwargs", [
    ("noam", dict(d_model=128, warmup_steps=5, scale=2.0)),
    ("warmup_cosine", dict(peak_lr=2e-3, warmup_steps=5, total_steps=30, end_lr=1e-5)),
    ("warmup_times_cosine", dict(peak_lr=2e-3, warmup_steps=5, total_steps=30)),
    ("warmup_rsqrt", dict(peak_lr=1e-3, warmup_steps=5)),
    ("constant", dict(lr=1e-3, warmup_steps=5)),
    ("constant", dict(lr=1e-3)),
])
def test_every_schedule_has_a_lambda_lr_twin(name, kwargs):
    """``interop.torch_train.lr_lambda``: LambdaLR gives each update the rate of the schedule."""
    from transformer_jax.interop.torch_train import lr_lambda

    base_lr, factor = lr_lambda(name, **kwargs)
    want = _lambda_lr_rates(base_lr, factor, 40)
    got = _values(optim.make_schedule(name, **kwargs), range(40))
    assert _relative(got, want).max() < 1e-6
    assert set(optim.SCHEDULES) == {"noam", "warmup_cosine", "warmup_times_cosine",
                                    "warmup_rsqrt", "constant"}


def test_warmup_rsqrt_closed_form():
    peak, warm = 3e-4, 100
    sched = optim.warmup_rsqrt(peak, warm)
    steps = [0, 1, 50, 99, 100, 101, 400, 10_000]
    want = [
        peak * s / warm if s < warm else peak * math.sqrt(warm / s) for s in steps
    ]
    np.testing.assert_allclose(_values(sched, steps), want, rtol=1e-6)
    assert float(sched(400)) == pytest.approx(1.5e-4, rel=1e-6)


def test_constant():
    np.testing.assert_allclose(
        _values(optim.constant(0.1), [0, 1, 10**6]), [0.1] * 3, rtol=1e-7
    )
    np.testing.assert_allclose(
        _values(optim.constant(0.1, warmup_steps=4), [0, 1, 2, 4, 100]),
        [0.0, 0.025, 0.05, 0.1, 0.1],
        rtol=1e-6,
    )


def test_make_schedule_factory():
    a = optim.make_schedule("noam", d_model=64, warmup_steps=4000)
    assert float(a(8000)) == pytest.approx(0.0013975425, rel=1e-6)
    b = optim.make_schedule("constant", lr=0.5)
    assert float(b(3)) == 0.5
    with pytest.raises(ValueError) as err:
        optim.make_schedule("linear_cosine_whatever", lr=1.0)
    msg = str(err.value)
    assert "linear_cosine_whatever" in msg
    for name in ("noam", "warmup_cosine", "warmup_times_cosine", "warmup_rsqrt", "constant"):
        assert name in msg
    with pytest.raises(ValueError, match="noam"):
        optim.make_schedule("noam", d_model=64)  # missing warmup_steps


def test_schedule_argument_validation():
    with pytest.raises(ValueError):
        optim.noam(64, 0)
    with pytest.raises(ValueError):
        optim.warmup_cosine(1.0, 10, 10)
    with pytest.raises(ValueError):
        optim.warmup_rsqrt(1.0, 0)


# ---------------------------------------------------------------------------
# Weight-decay mask
# ---------------------------------------------------------------------------


def _sample_params():
    return {
        "params": {
            "embed": {"embedding": jnp.ones((10, 4))},
            "encoder": {
                "layer_0": {
                    "attention": {
                        "query": {"kernel": jnp.ones((4, 2, 2)), "bias": jnp.ones((2, 2))},
                    },
                    "ln": {"scale": jnp.ones(4), "bias": jnp.zeros(4)},
                    "mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
                }
            },
            "final_norm": {"scale": jnp.ones(4)},
        }
    }


def test_decay_mask_on_nested_params():
    mask = optim.decay_mask(_sample_params())
    assert mask == {
        "params": {
            "embed": {"embedding": True},
            "encoder": {
                "layer_0": {
                    "attention": {"query": {"kernel": True, "bias": False}},
                    "ln": {"scale": False, "bias": False},
                    "mlp": {"kernel": True, "bias": False},
                }
            },
            "final_norm": {"scale": False},
        }
    }


def test_decay_mask_frozen_dict_and_boxed_params():
    import flax.linen as nn
    from flax.core import FrozenDict

    frozen = optim.decay_mask(FrozenDict({"d": {"kernel": 1.0, "bias": 0.0}}))
    assert dict(frozen["d"]) == {"kernel": True, "bias": False}
    boxed = {"d": {"kernel": nn.Partitioned(jnp.ones((2, 2)), names=("a", "b"))}}
    assert jax.tree.leaves(optim.decay_mask(boxed)) == [True]


def test_weight_decay_skips_bias_and_norm():
    params = {"d": {"kernel": jnp.full((2,), 2.0), "bias": jnp.full((2,), 2.0)},
              "n": {"scale": jnp.full((2,), 2.0)}}
    tx = optim.make_optimizer(schedule=0.1, weight_decay=0.5, clip_norm=None)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    # Zero gradients: only decoupled decay moves parameters: -lr * wd * p.
    np.testing.assert_allclose(updates["d"]["kernel"], [-0.1, -0.1], rtol=1e-6)
    np.testing.assert_array_equal(updates["d"]["bias"], [0.0, 0.0])
    np.testing.assert_array_equal(updates["n"]["scale"], [0.0, 0.0])


# ---------------------------------------------------------------------------
# make_optimizer vs torch.optim.AdamW
# ---------------------------------------------------------------------------


def test_make_optimizer_defaults():
    sig = inspect.signature(optim.make_optimizer)
    assert (sig.parameters["b1"].default, sig.parameters["b2"].default) == (0.9, 0.98)
    assert sig.parameters["eps"].default == 1e-9
    assert sig.parameters["weight_decay"].default == 0.01
    assert sig.parameters["clip_norm"].default == 1.0


def test_make_optimizer_matches_torch_adamw():
    """Three updates with default b1/b2/eps/weight decay equal torch AdamW.

    With a single step Adam's update is g / (|g| + eps) whatever the betas, so
    several steps with changing gradients are needed to pin b1 and b2 down.
    Decay goes to the kernel only (torch: a second parameter group with
    weight_decay=0 for the bias).
    """
    rng = np.random.default_rng(0)
    kernel0 = rng.normal(size=(3, 4)).astype(np.float32)
    bias0 = rng.normal(size=(4,)).astype(np.float32)
    grads = [
        (rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32))
        for _ in range(3)
    ]
    lr = 1e-2

    tx = optim.make_optimizer(schedule=optax.constant_schedule(lr), clip_norm=None)
    params = {"dense": {"kernel": jnp.asarray(kernel0), "bias": jnp.asarray(bias0)}}
    state = tx.init(params)
    for gk, gb in grads:
        g = {"dense": {"kernel": jnp.asarray(gk), "bias": jnp.asarray(gb)}}
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)

    tk = torch.nn.Parameter(torch.tensor(kernel0))
    tb = torch.nn.Parameter(torch.tensor(bias0))
    topt = torch.optim.AdamW(
        [{"params": [tk], "weight_decay": 0.01}, {"params": [tb], "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-9,
    )
    for gk, gb in grads:
        tk.grad = torch.tensor(gk)
        tb.grad = torch.tensor(gb)
        topt.step()

    np.testing.assert_allclose(params["dense"]["kernel"], tk.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(params["dense"]["bias"], tb.detach().numpy(), atol=1e-6)

    # Sanity check that the comparison is sensitive to b2: torch's default
    # b2=0.999 gives different parameters.
    tk2 = torch.nn.Parameter(torch.tensor(kernel0))
    topt2 = torch.optim.AdamW([tk2], lr=lr, betas=(0.9, 0.999), eps=1e-9, weight_decay=0.01)
    for gk, _ in grads:
        tk2.grad = torch.tensor(gk)
        topt2.step()
    assert np.max(np.abs(np.asarray(params["dense"]["kernel"]) - tk2.detach().numpy())) > 1e-5


def test_make_optimizer_uses_schedule_per_update():
    sched = optim.constant(1.0, warmup_steps=2)  # 0, 0.5, 1, 1, ...
    tx = optim.make_optimizer(schedule=sched, weight_decay=0.0, clip_norm=None)
    params = {"kernel": jnp.zeros(())}
    state = tx.init(params)
    deltas = []
    for _ in range(3):
        updates, state = tx.update({"kernel": jnp.ones(())}, state, params)
        deltas.append(float(updates["kernel"]))
    # Adam's normalised step is ~1 for a constant gradient, so the update is
    # -lr(k) for update k = 0, 1, 2.
    np.testing.assert_allclose(deltas, [0.0, -0.5, -1.0], atol=1e-6)


def _first_moment(opt_state):
    """The Adam first moment ``mu`` inside a (possibly chained) optax state."""
    return optax.tree.get(opt_state, "mu")


def test_clipping_caps_global_norm():
    big = {"a": jnp.full((4,), 3.0), "b": {"kernel": jnp.full((2, 2), 4.0)}}
    assert float(optax.tree.norm(big)) == pytest.approx(10.0)
    b1 = 0.9
    for clip, grads, want_norm in [(1.0, big, 1.0), (0.5, big, 0.5),
                                   (100.0, big, 10.0), (None, big, 10.0)]:
        tx = optim.make_optimizer(schedule=1.0, b1=b1, clip_norm=clip)
        params = jax.tree.map(jnp.zeros_like, grads)
        _, state = tx.update(grads, tx.init(params), params)
        # After one update mu = (1 - b1) * g_seen, so mu / (1 - b1) is the
        # gradient AdamW received after clipping.
        seen = jax.tree.map(lambda m: m / (1 - b1), _first_moment(state))
        assert float(optax.tree.norm(seen)) == pytest.approx(want_norm, rel=1e-5)
        # Clipping rescales the whole tree uniformly (direction preserved).
        np.testing.assert_allclose(
            seen["a"] / seen["b"]["kernel"][0, 0], big["a"] / 4.0, rtol=1e-5
        )
    with pytest.raises(ValueError):
        optim.make_optimizer(schedule=1.0, clip_norm=0.0)


def test_mu_dtype_is_used():
    tx = optim.make_optimizer(schedule=1e-3, mu_dtype=jnp.bfloat16)
    state = tx.init({"kernel": jnp.ones((2, 2))})
    assert _first_moment(state)["kernel"].dtype == jnp.bfloat16


def test_warmup_times_cosine_takes_no_end_rate():
    """Its cosine ends at 0: an end_learning_rate would be ignored, so the config refuses it."""
    from transformer_jax.errors import UserError
    from transformer_jax.train.config import ExperimentConfig

    cfg = ExperimentConfig(schedule="warmup_times_cosine", steps=30, warmup_steps=5)
    assert cfg.schedule_kwargs(d_model=64) == dict(peak_lr=2e-3, warmup_steps=5, total_steps=30)
    with pytest.raises(UserError, match=r"end_learning_rate=0.0001 must be 0 for "
                                        r"schedule='warmup_times_cosine'"):
        ExperimentConfig(schedule="warmup_times_cosine", end_learning_rate=1e-4)
