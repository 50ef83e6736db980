"""transformer_jax.nnx: every family as a Flax NNX module (``to_nnx``, over ``nnx.bridge``).

One device here: the wrapper's outputs equal Linen ``apply`` with the same params, one
``nnx.Optimizer`` step lowers a real loss, Hugging Face weights load. The mesh checks run in
``tests/nnx_worker.py`` on 4 simulated CPU devices (the families are defined there).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import flax.linen as nn
import pytest
from flax import nnx
from jax.sharding import AxisType

from transformer_jax import to_nnx
from transformer_jax.errors import UserError
from transformer_jax.nnx import linen_params
from tests.nnx_worker import cases

HERE = Path(__file__).resolve().parent
FAMILIES = list(cases())


@pytest.fixture(scope="module")
def families():
    return cases()


def assert_trees_close(got, want, atol):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=0, atol=atol), got, want)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.colab] * (n == "gpt")) for n in FAMILIES])
def test_wrapper_equals_linen_and_an_optimizer_step_lowers_the_loss(name, families):
    module, inputs, loss_of, lr = families[name]
    model = to_nnx(module, *inputs, rngs=nnx.Rngs(0))
    params = linen_params(model)

    def with_output(out):
        return loss_of(out), out

    @jax.jit
    def linen(params):        # (loss, output), gradient: Linen apply
        return jax.value_and_grad(lambda p: with_output(module.apply({"params": p}, *inputs)),
                                  has_aux=True)(params)

    @nnx.jit
    def step(model, optimizer):
        (loss, out), grads = nnx.value_and_grad(lambda m: with_output(m(*inputs)), has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, out, nnx.to_pure_dict(grads)

    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    before, out, grads = step(model, optimizer)
    (want_loss, want_out), want_grads = linen(params)
    assert_trees_close(out, want_out, atol=1e-6)
    assert float(before) == pytest.approx(float(want_loss), rel=1e-6)
    # the same gradient, each leaf to 1e-5 of its largest entry (a key bias's is 0 +- 1e-12:
    # softmax ignores a shift)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(want_grads)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(
        g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()) + 1e-9), grads, want_grads)
    (after, _), _ = linen(linen_params(model))
    assert float(after) < float(before) - 0.01, (float(before), float(after))


@pytest.mark.colab
def test_params_load_and_are_checked(families):
    module, (ids,), _, _ = families["gpt"]
    boxed = jax.jit(module.init)(jax.random.key(7), ids)["params"]   # as init returns them
    params = nn.meta.unbox(boxed)
    model = to_nnx(module, ids, params=boxed)
    assert_trees_close(linen_params(model), params, atol=0)
    assert_trees_close(model(ids), module.apply({"params": params}, ids), atol=1e-6)

    broken = jax.tree_util.tree_map(lambda x: x, params)
    del broken["wte"]
    broken["h_0"]["mlp"]["wi"]["kernel"] = broken["h_0"]["mlp"]["wi"]["kernel"][:, :255]
    with pytest.raises(UserError, match=r"^to_nnx: params do not fit the module: missing "
                                        r"wte/embedding; h_0/mlp/wi/kernel has shape \(64, 255\), "
                                        r"the module's is \(64, 256\); pass the params"):
        to_nnx(module, ids, params=broken)
    with pytest.raises(UserError, match=r"missing h_0/mlp/wi/bias; missing h_0/mlp/wi/kernel; missing "
                                        r"h_0/mlp/wo/bias \(and 37 more\); .*without the outer "
                                        r"\{'params': \.\.\.\}$"):
        to_nnx(module, ids, params={"params": params})


@pytest.mark.colab
def test_a_mesh_the_models_cannot_use_is_a_user_error(families):
    module, (ids,), _, _ = families["gpt"]
    with pytest.raises(UserError, match=r"^to_nnx: the mesh's axes are Explicit; .* needs Auto axes"):
        to_nnx(module, ids, mesh=jax.make_mesh((1,), ("model",), axis_types=(AxisType.Explicit,)))
    with pytest.raises(UserError, match=r"^to_nnx: the logical-axis rules map onto mesh axes data, "
                                        r"fsdp, tensor, which the mesh \(model\) lacks; build it "
                                        r"with transformer_jax.sharding.make_mesh"):
        to_nnx(module, ids, mesh=jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,)))


def test_hugging_face_weights_in_the_nnx_module():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.interop.conftest import gpt2_model, perturbed
    from tests.interop.test_hf_llama import LLAMA_TINY
    from transformer_jax.interop import from_hf

    ids = np.random.default_rng(3).integers(0, 101, (2, 12)).astype(np.int32)
    llama = perturbed(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY)))
    for hf_model in (gpt2_model(), llama):
        module, params = from_hf(hf_model)
        model = to_nnx(module, ids, params=params)
        with torch.no_grad():
            want = hf_model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(np.asarray(nnx.jit(lambda m: m(ids))(model)), want,
                                   rtol=1e-5, atol=1e-5, err_msg=type(hf_model).__name__)


@pytest.mark.slow
@pytest.mark.colab
def test_on_a_mesh_params_are_sharded_by_the_logical_axis_rules():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip(),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "nnx_worker.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    # every parameter of every family: the NNX array's sharding == the Linen training path's
    # (sharding.param_shardings), over fsdp=2 x tensor=2
    families = out["families"]
    assert {name: f["differ"] for name, f in families.items()} == {name: {} for name in FAMILIES}
    # GPT: 20 params; the six of the norms (norm axis) replicated, the other 14 split
    assert (families["gpt"]["params"], families["gpt"]["sharded"]) == (20, 14)
    assert all(f["sharded"] > f["params"] // 2 for f in families.values()), families
    gpt = out["gpt"]   # vocabulary 511: not divisible by tensor=2, so only embed is split
    assert gpt["specs"] == {"wte/embedding": "P(None, 'fsdp')", "h_0/mlp/wi/kernel": "P('fsdp', 'tensor')",
                            "h_0/self_attn/query/kernel": "P('fsdp', 'tensor')", "h_0/norm1/scale": "P()"}
    assert gpt["mu_spec"] == "P('fsdp', 'tensor')"           # Adam's moments follow their param
    assert gpt["logits_sharding"] == "P('fsdp',)"            # the batch over data x fsdp
    assert gpt["logits_max_diff"] <= 1e-5                    # == the unsharded model
    before, after = gpt["loss"]
    assert after < before - 0.01, gpt["loss"]
