"""Compiled, not just lowered: the real TPU compiler (libtpu) on this CPU host.

``jax.experimental.topologies`` gives the devices of a TPU slice without the hardware; a
step jitted with shardings on a mesh of them compiles for that slice (XLA:TPU, and Mosaic
for the Pallas kernels), and ``memory_analysis()`` says what each device needs. Tiny
models of every family compile their train, eval and decode steps for v3 (XLA's attention:
Mosaic cannot compile Pallas kernels for v2/v3), v4, v5e, v5p and v6e; the flash kernel
compiles at the shapes its lowering tests use for every generation that takes it; a
multi-host slice compiles with a data x fsdp x tensor mesh and gathers no Q/K/V; an NF4
Dense compiles to the NF4 matmul kernels, no dequantized kernel outside them.

``make test`` installs libtpu (the ``tpu`` extra). Without it these tests skip, except
under CI, where a missing compiler is a failure.
"""
import importlib.util
import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import aot, hlo
from transformer_jax.errors import UserError
from transformer_jax.layers.flash_attention import flash_attention
from transformer_jax.layers.masks import AttentionPattern
from transformer_jax.tpu import GIB, TpuSlice
from transformer_jax.train.config import apply_overrides, load_experiment

if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs the TPU compiler: make test installs the 'tpu' extra "
                           "(libtpu); it is missing from this environment")
    pytest.skip("libtpu (the TPU compiler) is not installed: pip install -e '.[tpu]'",
                allow_module_level=True)

GENERATIONS = {"v3": "v3-8", "v4": "v4-8", "v5e": "v5e-4", "v5p": "v5p-8", "v6e": "v6e-4"}
KERNEL_SLICES = {"v4": "v4-8", "v5e": "v5e-1", "v5p": "v5p-8", "v6e": "v6e-1"}
MOSAIC = "tpu_custom_call"

# the smallest models of each family: 2 layers, width 64-128, 4 heads of 32
TINY = {
    "gpt": ("stdlib_gpt", ["model.num_layers=2", "model.d_model=128", "model.num_heads=4",
                           "model.dropout_rate=0.0", "seq_len=128", "batch_size=8"]),
    "bert": ("bert_mlm_stdlib", ["model.num_layers=2", "model.d_model=128",
                                 "model.num_heads=4", "model.mlp_dim=256", "seq_len=128",
                                 "batch_size=8", "model.dropout_rate=0.0",
                                 "model.attention_dropout_rate=0.0"]),
    "t5": ("t5_stdlib_seq2seq", ["model.num_layers=2", "model.d_model=128",
                                 "model.num_heads=4", "model.head_dim=32", "model.mlp_dim=256",
                                 "batch_size=8", "model.dropout_rate=0.0"]),
    "vit": ("vit_digits", ["model.num_layers=2", "model.d_model=128", "model.num_heads=4",
                           "model.mlp_dim=256", "batch_size=8", "model.dropout_rate=0.0"]),
    # Llama 3's RoPE scaling (64 original positions < seq_len), QLoRA: adapters over NF4
    "llama3+qlora": ("stdlib_gpt", ["model=gpt", "model_preset=llama-tiny", "seq_len=128",
                                   "batch_size=8", "lora.rank=4", "lora.quantize=nf4",
                                   'model.rope_scaling={"kind": "llama3", "original_max_len": 64}']),
    # Qwen 3: per-head q/k RMSNorm and a head size (64) that is not D / N (32)
    "qwen3": ("stdlib_gpt", ["model=gpt", "model_preset=qwen3-tiny", "model.head_size=64",
                             "seq_len=128", "batch_size=8"]),
    # 3 layers: local (a window of 32 of the 128 tokens), local, global
    "gemma": ("stdlib_gpt", ["model=gemma", "model_preset=gemma3-tiny", "model.num_layers=3",
                             "model.head_dim=32", "model.sliding_window=32", "seq_len=128",
                             "batch_size=8"]),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def tiny(family: str, data_dir: str, *more: str):
    name, overrides = TINY[family]
    return apply_overrides(load_experiment(name), [*overrides, f"data_dir={data_dir}", *more])


# Every family on v5e (splash; T5 on the Pallas kernel for its bias); XLA's attention on
# v3 with GPT and with T5's relative bias (the other families reach the same attention code
# and compile on v5e); the other generations, which take the same kernels as v5e, with GPT:
# 12 compiles instead of the 35 of every pair, and no family or generation left out.
COMPILED = ([(family, "v5e") for family in TINY] + [("gpt", "v3"), ("t5", "v3")]
            + [("gpt", generation) for generation in GENERATIONS if generation not in ("v3", "v5e")])


@pytest.mark.slow
@pytest.mark.parametrize("family,generation", [pytest.param(*case, marks=[pytest.mark.colab] * (case == ("gpt", "v5e")))
                                               for case in COMPILED])
def test_tiny_train_steps_compile_for_every_generation(family, generation, data_dir):
    """bf16 train steps of every family compile on v5e, GPT's for each generation and T5's
    on v3 too: from v4 on JAX's splash kernel, our Pallas kernel for T5's relative bias (3
    Mosaic calls per attention call: forward, dK/dV, dQ), XLA's attention on v3; the
    compiler's memory figures add up."""
    # v4: the layers scanned (one while loop, its body counted twice for the FLOPs)
    scan = ["model.scan_layers=true"] * ((family, generation) == ("gpt", "v4"))
    cfg = tiny(family, data_dir, "model.dtype=bfloat16", *scan)
    report = aot.compile_experiment(cfg, GENERATIONS[generation], mesh="data=-1")
    kernel = generation != "v3"
    path = ("pallas" if family == "t5" else "splash") if kernel else "xla"
    assert report.attention == f"{path} (tpu {generation})"
    # per attention call: forward, dK/dV, dQ (and the forward again under remat)
    assert (report.mosaic_kernels >= 3) if kernel else (report.mosaic_kernels == 0)
    assert report.fits and 0 < report.per_device_bytes < GIB
    assert report.per_device_bytes == (report.argument_bytes + report.temp_bytes
                                       + report.output_bytes - report.alias_bytes)
    assert report.parameter_bytes + report.optimizer_bytes + report.batch_bytes <= \
        report.argument_bytes
    # data parallel: the gradients are summed over the devices
    assert report.collectives["all-reduce"]["count"] >= 1
    if family == "gpt":     # the compiled FLOPs of all devices against 6N + attention
        assert 0.8 < report.flops_ratio < 1.6, report.flops_ratio


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v3", "v5e"])
def test_eval_and_decode_steps_compile(generation, data_dir):
    """The eval step (GPT, and ViT's classifier) and generate's KV-cache loop (GPT; Gemma's
    on v5e) compile; the decode loop takes the reference for its one-row steps and the
    kernel for the prefill."""
    tpu = GENERATIONS[generation]
    gpt = tiny("gpt", data_dir, "model.dtype=bfloat16")
    for what in ("eval", "decode"):
        report = aot.compile_experiment(gpt, tpu, what=what)
        assert report.fits and report.per_device_bytes > 0
        assert report.optimizer_bytes == 0
        assert (report.mosaic_kernels > 0) == (generation != "v3"), what
    # seq_len 128: 64-token prompts, 64 tokens generated, the prompts split over the devices
    assert report.decode_shape == dict(batch=8, prompt_len=64, new_tokens=64, max_len=256)
    assert report.batch_bytes == 8 * 64 * 4 // report.devices + 2 * 4
    assert report.estimated_step_seconds > 0 and "read per device per token" in \
        report.estimate_basis
    if generation == "v5e":    # Gemma: a ring of W cache slots on its local layers
        gemma = aot.compile_experiment(tiny("gemma", data_dir, "model.dtype=bfloat16"), tpu,
                                       what="decode")
        assert gemma.fits and gemma.mosaic_kernels > 0
    vit = aot.compile_experiment(tiny("vit", data_dir), tpu, what="eval")
    assert vit.fits and vit.optimizer_bytes == 0
    with pytest.raises(UserError, match="decode compiles the KV-cache loop of a language model"):
        aot.compile_experiment(tiny("vit", data_dir), tpu, what="decode")


def _kernel_program(generation: str, t: int, head_dim: int, *, kv_heads: int = 2,
                    bias: bool = False, pattern=None):
    devices = TpuSlice.parse(KERNEL_SLICES[generation]).jax_devices()[:1]
    mesh = jax.make_mesh((1,), ("x",), devices=devices)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, 4, head_dim), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, t, kv_heads, head_dim), jnp.bfloat16, sharding=sharding)
    b = jax.ShapeDtypeStruct((1, 4, t, t), jnp.float32, sharding=sharding) if bias else None

    def loss(q, k, v, b):
        out = flash_attention(q, k, v, bias=b, causal=True, platform="tpu", pattern=pattern)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, b).lower()
        return lowered, lowered.compile()


@pytest.mark.slow
@pytest.mark.parametrize("generation", list(KERNEL_SLICES))
def test_flash_kernel_compiles_with_mosaic_for_every_generation_that_takes_it(generation):
    """Forward + backward of the flash kernel, bf16, causal, compiled by Mosaic and XLA:TPU:
    head dims 64 and 128 at 128 tokens (one block) and 8,192 (the most VMEM: the dK/dV
    kernel holds whole-length rows; 2,048 takes the same blocks and less), grouped-query
    attention (4 query heads on 2 and 1 kv heads), an additive bias, a sliding window."""
    cases = [dict(t=t, head_dim=h) for h in (64, 128) for t in (128, 8192)]
    cases += [dict(t=512, head_dim=64, kv_heads=1), dict(t=512, head_dim=64, bias=True),
              dict(t=1024, head_dim=64, pattern=AttentionPattern("window", 256))]
    for case in cases:
        lowered, compiled = _kernel_program(generation, **case)
        # forward, dK/dV, dQ; and dS for the bias gradient
        assert lowered.as_text().count(MOSAIC) == 3 + case.get("bias", False), case
        mem = compiled.memory_analysis()
        t, h = case["t"], case["head_dim"]
        # the kernel never holds the (T, T) weights: far below one (4, T, T) fp32 matrix
        assert mem.temp_size_in_bytes < 4 * t * t * 4 or t <= 512, (case, mem)
        assert mem.argument_size_in_bytes >= 2 * t * h * (4 + 2 * case.get("kv_heads", 2))


def test_pallas_on_v3_is_one_clear_error():
    """Asking for the Pallas kernel where Mosaic cannot compile it is refused by name."""
    from transformer_jax.layers import resolve_implementation
    with pytest.raises(UserError, match="cannot run on a TPU v3.*v4 and later"):
        resolve_implementation("pallas", "tpu", tpu_generation=3)
    assert resolve_implementation("auto", "tpu", tpu_generation=3) == "xla"
    assert resolve_implementation("auto", "tpu", tpu_generation=2, q_len=8192,
                                  kv_len=8192) == "chunked"
    assert resolve_implementation("auto", "tpu", tpu_generation=4) == "splash"
    assert resolve_implementation("auto", "tpu") == "splash"    # unknown: as lowering assumes
    assert resolve_implementation("auto", "tpu", tpu_generation=4, bias=True) == "pallas"


@pytest.mark.slow
def test_multi_host_slice_shards_attention_without_gathering_qkv(data_dir):
    """v4-32 (16 chips on 4 hosts) with data=2, fsdp=4, tensor=2: each device holds an
    eighth of the parameters' big matrices and runs the kernel on its own rows and heads;
    no all-gather in the compiled program is the size of a whole Q, K or V."""
    cfg = tiny("gpt", data_dir, "model.dtype=bfloat16", "model.num_heads=8",
               "model.d_model=256", "batch_size=32")
    report, text = _compiled(cfg, "v4-32", "data=2,fsdp=4,tensor=2")
    assert (report.devices, report.hosts) == (16, 4)
    assert report.mesh == "data=2,fsdp=4,tensor=2"
    assert report.mosaic_kernels >= 3         # forward, dK/dV, dQ of the (scanned) layers
    # per device, Q/K/V of one layer: (B/(data*fsdp), T, N/tensor, H) bf16; all of it
    full_qkv = 32 * 128 * 8 * 32 * 2
    gathers = [int(b) for b in _all_gather_bytes(text)]
    assert gathers, "fsdp gathers the parameters before use"
    assert max(gathers) < full_qkv, (max(gathers), full_qkv)
    # parameters: 2 layers of 12 D^2 weights, sharded 8 ways (fsdp x tensor) plus the
    # replicated small vectors; far below the unsharded 2 x 12 x 256^2 x 4 bytes
    assert report.parameter_bytes < 2 * 12 * 256 * 256 * 4 / 4


def _compiled(cfg, tpu, mesh):
    """The report and the compiled program's HLO text, from one compile."""
    captured = {}
    real = aot._compile

    def keep(lowered, slice_):
        compiled, oom = real(lowered, slice_)
        captured["text"] = compiled.as_text()
        return compiled, oom

    aot._compile = keep
    try:
        report = aot.compile_experiment(cfg, tpu, mesh=mesh)
    finally:
        aot._compile = real
    return report, captured["text"]


def _all_gather_bytes(text: str):
    for line in text.splitlines():
        m = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
        if m:
            yield hlo.result_bytes(m.group(1), "-start(" in line)


def test_collectives_are_counted_through_loops():
    """A while loop's body counts its trip count times (XLA's known count, or the bound
    of an ``i < N`` condition); tuples of a combined collective add up."""
    text = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[] constant(12)
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), to_apply=%add
  %ag = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

ENTRY %main (a: f32[8], b: bf16[4,4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %both = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), to_apply=%add
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    assert aot.collectives(text) == {
        "all-gather": {"count": 12, "bytes": 12 * 64 * 4},
        "all-reduce": {"count": 13, "bytes": 8 * 4 + 16 * 2 + 12 * 8 * 4}}


def test_tpu_types_name_their_slices():
    """Cloud accelerator types -> JAX topologies, devices and hosts."""
    cases = {"v2-8": ("v2:2x2", 8, 1), "v3-32": ("v3:4x4", 32, 4), "v4-8": ("v4:2x2x1", 4, 1),
             "v4-32": ("v4:2x2x4", 16, 4), "v5p-8": ("v5p:2x2x1", 4, 1),
             "v5e-1": ("v5e:1x1", 1, 1), "v5litepod-8": ("v5e:2x4", 8, 1),
             "v5e-16": ("v5e:4x4", 16, 4), "v6e-4": ("v6e:2x2", 4, 1),
             "v6e-256": ("v6e:16x16", 256, 64)}
    for name, (topology, devices, hosts) in cases.items():
        s = TpuSlice.parse(name)
        assert (s.topology, s.devices, s.hosts) == (topology, devices, hosts), name
    assert TpuSlice.from_topology("v5e:2x4") == TpuSlice.parse("v5e-8")
    for bad, match in (("tpu", "not a TPU type"), ("v9-8", "unknown TPU generation"),
                       ("v4-12", "power of two"), ("v5e-2", "-1, -4, -8")):
        with pytest.raises(UserError, match=match):
            TpuSlice.parse(bad)
    for name in ("v2-8", "v5e-1", "v4-32"):
        devices = TpuSlice.parse(name).jax_devices()
        assert len(devices) == TpuSlice.parse(name).devices
        assert len({d.process_index for d in devices}) == TpuSlice.parse(name).hosts


@pytest.mark.slow
def test_the_cli_reports_fits_or_not_with_its_exit_status(data_dir, capsys):
    """``transformer-jax compile``: exit 0 and a JSON last line when it fits; exit 2 and one
    ``error:`` line naming the levers for one chip (no mesh) when the compiler runs out of
    HBM (a batch of 8,192 sequences on one v5e chip), with its need broken down into parts
    that add up to it, the outputs (the train state, written over the donated one)
    counted; bad TPU types and pallas on a v3 are one ``error:`` line.
    The fitting run takes a batch of 8: XLA:TPU's compile time grows with the batch (16 s
    at 8 sequences, 45 s at the default 32 on 2 cores), and one that fits shows as much."""
    from transformer_jax import cli
    base = ["compile", "--experiment", "stdlib_gpt", f"--set=data_dir={data_dir}",
            "--set=model.num_layers=2", "--set=model.dropout_rate=0.0", "--json"]
    assert cli.main(base + ["--tpu", "v5e-1", "--set=batch_size=8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    row = json.loads(out[-1])
    assert row["fits"] is True and row["devices"] == 1 and row["hbm_bytes"] == 16 * GIB
    assert 0 < row["per_device_bytes"] < GIB and row["attention"] == "splash (tpu v5e)"
    assert any(line.startswith("attention: splash (tpu v5e)") and "MaxText's default" in line
               for line in out)
    # the roofline: the compiled program's matmul FLOPs (with the flash kernels' recomputed
    # logits) within 0.8-1.6 of the model's 6N + attention (measured: 1.06), its time the
    # slower of FLOPs at v5e's 197 TFLOP/s and HBM bytes at 0.82 TB/s (a lower bound)
    assert 0.8 < row["compiled_flops"] / row["flops_per_step"] == row["flops_ratio"] < 1.6
    compute, memory = row["compiled_flops"] / 197e12, row["compiled_hbm_bytes"] / 0.82e12
    assert row["roofline_seconds"] == max(compute, memory) > 0
    assert row["roofline_bound"] == ("compute" if compute >= memory else "memory")
    assert 8 * 2**20 < row["compiled_hbm_bytes"] < 64 * 2**20   # the state, read and written
    assert any(line.startswith("roofline (a lower bound on the step time, not a measurement): ")
               and line.endswith(f"compiled / model FLOPs {row['flops_ratio']:.2f}") for line in out)

    assert cli.main(base + ["--tpu", "v5e-1", "--set=batch_size=8192"]) == 2
    captured = capsys.readouterr()
    row = json.loads(captured.out.strip().splitlines()[-1])
    assert row["fits"] is False and row["per_device_bytes"] > 16 * GIB
    assert row["per_device_bytes"] == (row["argument_bytes"] + row["temp_bytes"]
                                       + row["output_bytes"] - row["alias_bytes"])
    state = row["parameter_bytes"] + row["optimizer_bytes"]
    assert state <= row["alias_bytes"] < row["output_bytes"] < state + 2**20
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "shard the" not in errors[0]
    for lever in ("--set model.remat=true", "--set batch_size=N", "--set accum_steps=N",
                  "--set model.param_dtype=bfloat16", "--tpu v5e-4 with --mesh fsdp=-1"):
        assert lever in errors[0]

    assert cli.main(["compile", "--experiment", "stdlib_gpt", "--tpu", "v9-8"]) == 2
    assert "unknown TPU generation" in capsys.readouterr().err
    assert cli.main(base + ["--tpu", "v3-8", "--set=model.attention_impl=pallas"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "cannot run on a TPU v3" in err


def test_libtpu_on_a_cpu_host_stays_quiet(tmp_path):
    """With libtpu installed and no TPU: importing the package and using JAX prints
    nothing, and a compile prints none of libtpu's metadata warnings."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    code = ("import transformer_jax, jax, jax.numpy as jnp; print(jax.devices()); "
            "from transformer_jax.tpu import TpuSlice; print(len(TpuSlice.parse('v5e-4')"
            ".jax_devices())); print(jax.jit(lambda x: x + 1)(jnp.ones(2)))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.splitlines()[:2] == ["[CpuDevice(id=0)]", "4"]


def test_topology_names_are_checked_as_tpu_types_are(here):
    """``--topology`` takes the grids the ``--tpu`` types lay out, and nothing else: a
    name no slice has (v5e:3x3, v5e:2x3 (no v5e-6), v5e:4x2, v4 as 2-D) is one error
    naming the nearest; what slips past reaches JAX and its refusal is one error too."""
    for topology, name in (("v4:2x2x1", "v4-8"), ("v5e:2x4", "v5e-8"), ("v5e:1x1", "v5e-1"),
                           ("v3:4x4", "v3-32"), ("v6e:16x16", "v6e-256")):
        assert TpuSlice.from_topology(topology) == TpuSlice.parse(name), topology
    nearest = {"v5e:3x3": "v5e:2x4 (8 chips) or v5e:4x4 (16 chips)",
               "v5e:2x3": "v5e:2x2 (4 chips) or v5e:2x4 (8 chips)",
               "v5e:4x2": "v5e:2x4 (8 chips)", "v4:2x2": "v4:2x2x1 (4 chips)",
               "v4:2x2x3": "v4:2x2x2 (8 chips) or v4:2x2x4 (16 chips)"}
    for topology, near in nearest.items():
        with pytest.raises(UserError) as e:
            TpuSlice.from_topology(topology)
        gen = topology.split(":")[0]
        assert str(e.value).startswith(f"--topology {topology!r} is not a {gen} slice: ")
        assert str(e.value).endswith(f"nearest: {near}")
    with pytest.raises(UserError) as e:
        TpuSlice.from_topology("v5e:3x3")
    listed = re.findall(r"(v5e:\w+) \(--tpu (v5e-\d+)\)", str(e.value))
    assert listed == [("v5e:1x1", "v5e-1"), ("v5e:2x2", "v5e-4"), ("v5e:2x4", "v5e-8"),
                      ("v5e:4x4", "v5e-16"), ("v5e:4x8", "v5e-32")]
    assert all(TpuSlice.from_topology(t).name == n for t, n in listed)
    with pytest.raises(UserError, match="power of two, at least 8"):
        TpuSlice.parse("v4-9")                  # an odd core count is no slice either
    # past the check (a slice made by hand): JAX's own refusal, as one UserError
    import dataclasses
    bad = dataclasses.replace(TpuSlice.parse("v5e-8"), topology="v5e:3x3", chips_per_host=None)
    with pytest.raises(UserError, match=r"cannot make topology 'v5e:3x3' \(INVALID_ARGUMENT: "
                                        r"Topology layout \"v5e:3x3\" is not divisible"):
        bad.jax_devices()
    for topology in ("v5e:3x3", "v5e:2x3"):
        status, out, lines = here("compile", "--experiment", "stdlib_gpt", "--topology", topology)
        assert (status, out) == (2, "")
        assert len(lines) == 1 and lines[0].startswith(f"error: --topology {topology!r} is not")


def test_an_imagenet_experiment_compiles_where_its_dataset_cannot_be_read(tmp_path, here,
                                                                        monkeypatch):
    """``compile --experiment vit_b16_tpu_v5e_1`` plans from any host: with TensorFlow and
    TFDS unimportable and imagenet2012 nowhere, the image shapes are the config's (ViT-B/16's
    1000 classes and 3 channels; the model cut to one narrow layer on 32-pixel images to
    compile in seconds); it prints the memory and says the dataset was not opened."""
    from transformer_jax.models import build_model
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    small = ["model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.mlp_dim=128",
             "model.image_size=32", "model.patch_size=8"]
    status, out, lines = here(
        "compile", "--experiment", "vit_b16_tpu_v5e_1", "--tpu", "v5e-1", "--json",
        f"--set=data_dir={tmp_path / 'empty'}", "--set=batch_size=8", "--set=accum_steps=1",
        *(f"--set={s}" for s in small))
    assert (status, lines) == (0, [])
    text = out.strip().splitlines()
    row = json.loads(text[-1])
    model_cfg, _ = build_model("vit", "B/16", {"dtype": "bfloat16", **{
        s.split("=")[0][len("model."):]: int(s.split("=")[1]) for s in small}})
    assert (model_cfg.num_classes, model_cfg.num_channels) == (1000, 3)
    assert row["fits"] and row["parameter_bytes"] == 4 * model_cfg.num_params()
    assert row["batch_bytes"] == 8 * 32 * 32 * 3 * 4 + 8 * 4 + 8 * 4   # images, labels, weights
    assert any(line.startswith("per device: arguments ") for line in text)
    assert "note: dataset 'imagenet2012' not opened: its shapes are the model config's " \
           "(num_classes=1000, num_channels=3; --set model.FIELD=N where the data's differ)" in text
    assert not (tmp_path / "empty").exists()


def test_decode_shape_fits_the_model_and_names_real_flags(data_dir, here):
    """``--what decode`` generates 64 tokens, or half of a shorter ``seq_len``/``max_len``;
    a ``--decode-tokens`` that leaves no room for a prompt is one error naming
    ``--decode-tokens`` and ``model.max_len``, both of which exist."""
    from transformer_jax.run import build
    short = tiny("gpt", data_dir, "model.max_len=32", "seq_len=32")
    long = tiny("gpt", data_dir, "model.max_len=256")
    short_cfg, long_cfg = build(short, {})[0], build(long, {})[0]
    assert aot.decode_shape(short, short_cfg, None) == dict(batch=8, prompt_len=16,
                                                            new_tokens=16, max_len=32)
    assert aot.decode_shape(long, long_cfg, None) == dict(batch=8, prompt_len=64,
                                                          new_tokens=64, max_len=256)
    assert aot.decode_shape(short, short_cfg, 31)["prompt_len"] == 1
    assert aot.decode_shape(long, long_cfg, 200) == dict(batch=8, prompt_len=1,
                                                         new_tokens=200, max_len=256)
    message = ("--decode-tokens 64 does not fit the model's max_len 32 (with a prompt of at "
               "least 1 token); give --decode-tokens 31 or fewer, or a longer model "
               "(--set model.max_len=N)")
    with pytest.raises(UserError) as e:
        aot.decode_shape(short, short_cfg, 64)
    assert str(e.value) == message
    with pytest.raises(UserError, match="generate at least 1 token"):
        aot.decode_shape(short, short_cfg, 0)
    base = ["compile", "--experiment", "stdlib_gpt", "--tpu", "v5e-1",
            f"--set=data_dir={data_dir}", "--set=model.max_len=32", "--set=seq_len=32"]
    assert here(*base, "--what", "decode", "--decode-tokens", "64") == (2, "", [f"error: {message}"])
    status, out, lines = here(*base, "--decode-tokens", "8")
    assert (status, out) == (2, "") and lines == [
        "error: --decode-tokens applies to --what decode, not --what train; drop it or add "
        "--what decode"]


def test_decode_report_has_its_shape_batch_and_a_roofline_time(data_dir, here):
    """The decode loop's report (one small compile): its shape, the prompts and key as its
    batch, and a time that is the prefill at the MFU plus each token reading the
    parameters and the KV cache at the v5e's 0.82 TB/s."""
    status, out, lines = here(
        "compile", "--experiment", "stdlib_gpt", "--tpu", "v5e-1", "--what", "decode",
        f"--set=data_dir={data_dir}", "--set=model.num_layers=2", "--set=model.max_len=32",
        "--set=seq_len=32", "--set=batch_size=8", "--set=model.dropout_rate=0.0", "--json")
    assert (status, lines) == (0, [])
    text = out.strip().splitlines()
    row = json.loads(text[-1])
    assert "decode: batch 8, prompts of 16 tokens, 16 tokens generated (model max_len 32)" in text
    assert row["decode_shape"] == dict(batch=8, prompt_len=16, new_tokens=16, max_len=32)
    assert row["batch_bytes"] == 8 * 16 * 4 + 2 * 4          # int32 prompts, a uint32 key
    assert row["optimizer_bytes"] == 0
    # K and V of 2 layers, 8 rows of 32 positions of d_model 128, fp32 (and the cache's
    # int32 position counters, a few bytes: rel 1e-5)
    cache = 2 * 2 * 8 * 32 * 128 * 4
    per_token = (row["parameter_bytes"] + cache) / 0.82e12
    prefill = row["flops_per_step"] * 16 / 32 / (197e12 * 0.4)
    assert row["estimated_step_seconds"] == pytest.approx(prefill + 16 * per_token, rel=1e-5)
    assert row["estimate_basis"].endswith(
        f"memory-bound: 2.2 MiB read per device per token (parameters "
        f"{row['parameter_bytes'] / 2**20:.1f} MiB, KV cache 512.0 KiB) at 0.82 TB/s HBM")
    assert any(ln.startswith("model FLOPs per step ") and "estimated decode time 0.0" in ln
               for ln in text)


def test_out_of_memory_advice_fits_the_slice(data_dir):
    """The levers an out-of-memory report names are real config names, and the mesh only
    where there is more than one device to shard over."""
    from transformer_jax.run import build
    cfg = tiny("gpt", data_dir)
    model_cfg = build(cfg, {})[0]
    one = {"data": 1, "fsdp": 1, "tensor": 1}
    assert aot.levers(cfg, model_cfg, TpuSlice.parse("v5e-1"), one, "train") == [
        "rematerialise the layers (--set model.remat=true)",
        "lower the batch (--set batch_size=N, or --set accum_steps=N for the same batch in "
        "micro-batches)",
        "keep the parameters and AdamW moments in bf16 (--set model.param_dtype=bfloat16)",
        "or take a larger slice (--tpu v5e-4 with --mesh fsdp=-1) or chips with more HBM "
        "(v4, v5p, v6e)"]
    eight = aot.levers(cfg, model_cfg, TpuSlice.parse("v5e-8"), dict(one, data=8), "train")
    assert eight[0] == "shard the parameters and optimizer state over the devices (--mesh fsdp=-1)"
    assert eight[-1].startswith("or take a larger slice (--tpu v5e-16 ")
    sharded = aot.levers(cfg, model_cfg, TpuSlice.parse("v5e-8"), dict(one, fsdp=8), "train")
    assert not any("shard the" in lever for lever in sharded)
    remat = build(tiny("gpt", data_dir, "model.remat=true", "model.param_dtype=bfloat16"), {})[0]
    assert aot.levers(cfg, remat, TpuSlice.parse("v5p-8"), dict(one, fsdp=4), "decode") == [
        "lower the batch (--set batch_size=N)", "generate fewer tokens (--decode-tokens N)",
        "or take a larger slice (--tpu v5p-16 with --mesh fsdp=-1)"]


def test_memory_breakdown_from_the_compilers_need_counts_the_outputs():
    """When the compiler states only its total need, the outputs come from the program:
    the donated state written back counts as aliased (as the compiler's own
    ``alias_size_in_bytes`` says for the same program), and the parts add up to the need."""
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])
    s = NamedSharding(mesh, PartitionSpec())
    state = {"w": jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=s),
             "mu": jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=s)}
    batch = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=s)

    def step(state, x):
        loss = jnp.sum((x @ state["w"]) ** 2)
        return {"w": state["w"] * 0.5, "mu": state["mu"] + loss}, loss

    fn = jax.jit(step, in_shardings=(s, s), out_shardings=(s, s), donate_argnums=(0,))
    lowered = fn.trace(state, batch).lower()
    need = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (1.50G) exceeds"
    over = aot._OverMemory(need)
    arg, temp, out, alias = aot.memory_figures(over, lowered, (state, batch))
    state_bytes = 2 * 256 * 64 * 4
    assert (arg, out, alias) == (state_bytes + 8 * 256 * 4, state_bytes + 4, state_bytes)
    assert arg + temp + out - alias == int(1.5 * GIB) == over.need
    assert alias == lowered.compile().memory_analysis().alias_size_in_bytes




@pytest.mark.slow
def test_the_harness_scores_an_8b_llama_in_bfloat16_over_a_v5e_8():
    """``eval --tasks --dtype bfloat16 --mesh fsdp=-1`` on a v5e-8: the harness's
    loglikelihood program for a batch of 16 rows of 2048 tokens compiles, its parameters
    split 8 ways (2.0 GB a chip of 16.1 GB), and the whole need fits the 16 GiB of HBM."""
    import flax.linen as nn

    from transformer_jax import sharding as sh
    from transformer_jax.eval_harness import harness_module, param_shardings, score_program
    from transformer_jax.models import GPT, GPTConfig

    # scanned: the compile takes ~40 s here instead of ~140 s unrolled
    module = harness_module(GPT(GPTConfig.preset("llama-3.1-8b", scan_layers=True)), "bfloat16")
    tpu = TpuSlice.parse("v5e-8")
    mesh = sh.make_mesh("fsdp=-1", devices=tpu.jax_devices())
    abstract = nn.meta.unbox(jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))["params"])
    param_sh = param_shardings(module, abstract, mesh)
    rows = sh.batch_sharding(mesh)
    batch = [jax.ShapeDtypeStruct((16, 2048), dtype, sharding=rows)
             for dtype in (jnp.int32, jnp.int32, jnp.bool_)]
    with sh.use_mesh(mesh):
        compiled = score_program(module, mesh, param_sh).trace(
            sh.with_shardings(abstract, param_sh), *batch).lower().compile()
    total = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(abstract))
    assert {str(a.dtype) for a in jax.tree_util.tree_leaves(abstract)} == {"bfloat16"}
    assert total == 2 * 8_030_261_248            # Llama 3.1 8B's parameters, 2 bytes each
    per_device = aot._per_device_bytes(abstract, param_sh)
    assert total / 8 <= per_device < total / 8 * 1.001      # only the norms stay whole
    mem = compiled.memory_analysis()
    batch_bytes = 16 * 2048 * (4 + 4 + 1) // 8
    # the compiler rounds small buffers (the norms, the mask) up: 4 KiB more here
    assert 0 <= mem.argument_size_in_bytes - (per_device + batch_bytes) < 2**16
    need = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
    assert need < 16 * GIB, need / GIB


def _qlora_8b_parameter_bytes(layers: int) -> int:
    """Bytes of ``llama3_8b_qlora_tpu_v5e_1``'s parameters with ``layers`` layers, from its
    shapes: the embedding and the untied head in bf16, and per layer the seven projections
    as NF4 (half a byte a weight + a float32 absmax per block of 64), two bf16 norms and the
    rank-16 bf16 adapters of the seven projections."""
    d, f, kv, vocab, r = 4096, 14336, 1024, 128256, 16
    weights = 2 * d * d + 2 * d * kv + 3 * d * f
    nf4 = weights // 2 + weights // 64 * 4
    adapters = r * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))
    return 2 * vocab * d * 2 + d * 2 + layers * (nf4 + 2 * d * 2 + adapters * 2)


@pytest.mark.parametrize("name,parameters", [("llama3_8b_qlora_tpu_v5e_1", 8_030_261_248),
                                             ("llama3_8b_lora_tpu_v5e_8", 8_030_261_248),
                                             ("llama3_2_1b_finetune_tpu_v5e_1", 1_235_814_400)])
def test_the_llama_experiments_build_meta_s_models(name, parameters, tmp_path):
    """What ``compile`` builds for each Llama experiment is Meta's model, parameter for
    parameter (Llama 3.1 8B, Llama 3.2 1B), though the check tokenizes bytes: the byte
    tokenizer's 259 ids do not shrink the 128256-word vocabulary. Shapes only."""
    import flax.linen as nn

    from transformer_jax.run import build

    cfg = load_experiment(name)
    task, overrides = aot._planned_task(cfg, str(tmp_path))
    model_cfg, model = build(cfg, overrides)
    assert (model_cfg.vocab_size, model_cfg.rope_scaling.kind) == (128256, "llama3")
    model_cfg = model_cfg.replace(lora=None)
    shapes = nn.meta.unbox(jax.eval_shape(lambda: type(model)(model_cfg).init(
        jax.random.PRNGKey(0), *task.init_args())))["params"]
    assert sum(a.size for a in jax.tree_util.tree_leaves(shapes)) == parameters


def test_the_8b_qlora_state_holds_the_nf4_base_and_moments_for_the_adapters_alone(data_dir):
    """``llama3_8b_qlora_tpu_v5e_1``'s train state as ``compile`` gives it to the compiler
    (shapes only; the full compile takes minutes here, its figures are in the experiment's
    docstring, and the ``llama3+qlora`` case compiles the same NF4 layout at a tiny size):
    the frozen base is NF4 (0.56 bytes a weight), only the adapters have AdamW moments, and
    the parameters are the 5.69 GiB the full compile reports."""
    from transformer_jax.run import build

    cfg = apply_overrides(load_experiment("llama3_8b_qlora_tpu_v5e_1"), [f"data_dir={data_dir}"])
    tpu = TpuSlice.parse("v5e-1")
    mesh = aot._mesh_for(cfg, tpu, None)
    task, overrides = aot._planned_task(cfg, data_dir)
    model_cfg, model = build(cfg, overrides)
    _, _, (parameter_bytes, optimizer_bytes, _), _, _, adapted = aot._state_and_step(
        cfg, task, model_cfg, model, mesh, "train", None)
    assert adapted == (0, 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432))   # no head; adapters
    assert parameter_bytes == _qlora_8b_parameter_bytes(32)
    adapters = 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2           # 32 layers, bf16
    assert adapters * 2 <= optimizer_bytes < adapters * 2 + 2**10       # mu, nu (+ counts)
    assert round(parameter_bytes / GIB, 2) == 5.69


def test_the_chunked_loss_frees_the_logits_on_a_v5e(data_dir):
    """The TPU compiler's temporaries for a tiny GPT's bf16 train step at 8 x 128 tokens
    and V = 32768 (128 MiB of float32 logits): at least the logits with the plain loss,
    under half of them with ``loss_chunk=16`` ((8, 16, V) logits a chunk: 16 MiB)."""
    logits_bytes = 8 * 128 * 32768 * 4

    def temp_bytes(chunk: int) -> int:
        cfg = tiny("gpt", data_dir, "model.vocab_size=32768", "batch_size=8",
                   "model.dtype=bfloat16", f"loss_chunk={chunk}")
        report = aot.compile_experiment(cfg, "v5e-1", mesh=None)
        assert report.fits
        return report.temp_bytes

    plain, chunked = temp_bytes(0), temp_bytes(16)
    assert plain >= logits_bytes and chunked < logits_bytes / 2, (plain, chunked)


def test_an_estimate_below_the_roofline_is_the_roofline(data_dir):
    """A tiny model at a v5e's 197 TFLOP/s x 40% would take less time than its compiled
    program's HBM traffic allows: the estimate is the roofline bound, and says so."""
    cfg = tiny("gpt", data_dir, "model.num_layers=1", "batch_size=1", "model.dtype=bfloat16")
    report = aot.compile_experiment(cfg, "v5e-1", mesh=None)
    mfu_seconds = report.flops_per_step / (197e12 * 0.4)
    assert mfu_seconds < report.roofline_seconds == report.estimated_step_seconds
    assert report.estimate_basis == (
        f"the roofline bound: model FLOPs / (1 devices x 197 TFLOP/s bf16 x 40% MFU) gives "
        f"{aot._ms(mfu_seconds)}, below the bound")
    assert report.flops_convention == ("6 per weight per token (forward, input and weight "
                                       "gradients), plus attention")


def test_an_nf4_dense_dequantizes_inside_its_matmul_on_a_v5e():
    """A QLoRA projection (NF4 in blocks of 64, 1,024 -> 4,096, bf16, 256 rows): its
    forward and input gradient compiled for v5e are the two Mosaic kernels of
    ``layers/quant_matmul.py``, 2 x 2 M K N FLOPs; outside them no array holds the
    kernel's 1024 x 4096 values, nor its 1024 x 2048 bytes in any dtype but the packed
    uint8; the HBM traffic is within 1.5x of what has to move (the codes, 2 MiB, their
    absmax, 256 KiB, and the activations x, dx and y's two halves, written and read back,
    3.5 MiB) and under one bf16 kernel (8 MiB): XLA's dequantization writes that, and its
    fp32 and unpacked int32 codes, per call."""
    from transformer_jax import sharding as sh
    from transformer_jax.layers import Dense, quant

    m, k, n = 256, 1024, 4096
    mesh = sh.make_mesh(None, devices=TpuSlice.parse("v5e-1").jax_devices())
    stored = jax.eval_shape(lambda: quant.quantize_kernel(jnp.zeros((k, n)), "nf4", 64))
    layer = Dense(n, use_bias=False, dtype=jnp.bfloat16)
    rep = sh.replicated(mesh)
    params = {key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep)
              for key, v in stored.items()}
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=rep)

    def loss(x, p):
        return jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32) ** 2)

    with sh.use_mesh(mesh):
        text = jax.jit(jax.grad(loss)).trace(x, params).lower().compile().as_text()
    program = hlo.Program(text)
    inside = hlo._inside_fusions(program)
    kernels = re.findall(r"%(nf4_matmul(?:_dx)?)\S* = .*custom-call\(", text)
    assert sorted(kernels) == ["nf4_matmul", "nf4_matmul_dx"]
    results = [hlo._SHAPE.findall(mm.group(2)) for comp, lines in program.comps.items()
               if comp not in inside for line in lines if (mm := hlo._INSTRUCTION.match(line))]
    sizes = [(dtype, math.prod(hlo._dims(dims))) for r in results for dtype, dims in r]
    assert ("u8", k * n // 2) in sizes
    assert [(d, s) for d, s in sizes if s == k * n or (s == k * n // 2 and d != "u8")] == []
    cost = hlo.costs(text)
    assert cost["flops"] == 2 * 2 * m * k * n
    moved = k * n // 2 + k * n // 64 * 4 + 2 * m * k * 2 + 2 * m * n * 2
    assert cost["bytes"] < 1.5 * moved and cost["bytes"] < k * n * 2, (cost, moved)
