"""Scale-out: meshes, pmap, multi-process runs and checkpoints that move between meshes.

The multi-device checks run in subprocesses on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts):
``tests/sharding_worker.py`` computes, and this file asserts. The single-device
references are computed here, in the test process (one CPU device).

Tolerances (fp32, matmul precision "highest"): a sharded step reorders float sums, so
losses agree to 1e-6 relative and gradients to 1e-5 (each gradient leaf relative to its
largest entry); over a few Adam steps losses stay within 1e-5 and parameters within 1e-4.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from transformer_jax import sharding as sh
from transformer_jax.train.config import ExperimentConfig, apply_overrides
from transformer_jax.run import train
from transformer_jax.train.monitor import read_metrics

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharding_worker.py"
STEPS = 6
TINY = [
    "model.num_layers=1", "model.d_model=64", "model.num_heads=8", "model.max_len=64",
    "seq_len=32", "batch_size=16", "schedule=constant", "learning_rate=3e-3", "warmup_steps=2",
    f"steps={STEPS}", "log_every=1", f"eval_every={STEPS}", "save_every=3", "keep=4",
    "eval_batches=1", "sample_tokens=0",
]


def env_with_devices(n: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               # n CPU devices, on top of conftest.py's compile flags (the programs are tiny)
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip(),
               SHARDING_TEST_OVERRIDES=json.dumps(TINY))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


class Worker:
    """``tests/sharding_worker.py`` on 8 simulated devices, started now, read on demand
    (the two workers and the in-process reference run use both cores side by side)."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], env=env_with_devices(8),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._result = None

    def result(self, timeout=900) -> dict:
        if self._result is None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
            assert self.proc.returncode == 0, out[-3000:] + err[-3000:]
            self._result = json.loads(out.strip().splitlines()[-1])
        return self._result


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def assert_curve(got: dict, want: dict, rtol=1e-5, what=""):
    got = {int(k): v for k, v in got.items()}
    assert sorted(got) == sorted(want), what
    np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                               rtol=rtol, err_msg=what)


# --------------------------------------------------------------------------- in process

def test_mesh_specs_and_errors():
    assert sh.parse_mesh(None) == sh.parse_mesh("") == {}
    assert sh.parse_mesh("data=2, fsdp=4") == {"data": 2, "fsdp": 4}
    assert sh.mesh_shape(None, 8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert sh.mesh_shape("fsdp=8", 8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert sh.mesh_shape("tensor=2,data=-1", 8) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ValueError, match=r"data=2,fsdp=2,tensor=1 has 4 devices, but this run has 8 devices"):
        sh.mesh_shape("data=2,fsdp=2", 8)
    with pytest.raises(ValueError, match=r"unknown axis 'fsd' \(did you mean 'fsdp'\?\)"):
        sh.parse_mesh("fsd=8")
    with pytest.raises(ValueError, match="not of the form AXIS=SIZE"):
        sh.parse_mesh("data:8")
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sh.parse_mesh("data=-1,fsdp=-1")
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        sh.mesh_shape("fsdp=3,data=-1", 8)
    with pytest.raises(ValueError, match="parallelism must be 'jit' or 'pmap'"):
        ExperimentConfig(parallelism="pjit")
    with pytest.raises(ValueError, match="unknown axis 'model'"):
        apply_overrides(ExperimentConfig(), ["mesh=model=2"])
    # one device: the default mesh is 1x1x1 and a 2-device mesh is a clear error
    assert dict(sh.make_mesh().shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="has 2 devices, but this run has 1 devices"):
        sh.make_mesh("data=2")


def test_logical_rules_and_indivisible_dims():
    mesh = AbstractMesh((2, 2, 2), sh.MESH_AXES)
    rules = sh.LOGICAL_AXIS_RULES
    assert sh.logical_to_spec(("embed", "heads", "head_dim"), (64, 8, 8), mesh, rules) == P("fsdp", "tensor")
    assert sh.logical_to_spec(("heads", "head_dim", "embed"), (8, 8, 64), mesh, rules) == P("tensor", None, "fsdp")
    assert sh.logical_to_spec(("layers", "embed", "mlp"), (4, 64, 256), mesh, rules) == P(None, "fsdp", "tensor")
    assert sh.logical_to_spec(("norm",), (64,), mesh, rules) == P()
    assert sh.logical_to_spec(("no_such_name", "embed"), (3, 64), mesh, rules) == P(None, "fsdp")
    notes = []   # GPT-2's vocabulary (50257) is odd: that dim stays whole on every device
    assert sh.logical_to_spec(("vocab", "embed"), (50257, 768), mesh, rules, notes=notes, what="wte") == P(None, "fsdp")
    assert notes == ["wte dim 0 (vocab=50257) is not divisible by tensor=2; replicated"]
    notes = []   # a batch of 6 over data x fsdp = 4: keeps the part that divides
    assert sh.logical_to_spec(("act_batch",), (6,), mesh, rules, notes=notes) == P("data")
    assert "sharded over data only" in notes[0]


def _logical_names_in_source() -> set[str]:
    """Every string literal in the axis-name arguments of the layers and models."""
    names = set()
    markers = ("kernel_axes=", "embedding_axes=", "with_logical_partitioning(", "with_logical_constraint(")
    for path in (HERE.parent / "transformer_jax").rglob("*.py"):
        text = path.read_text()
        for marker in markers:
            for m in re.finditer(re.escape(marker), text):
                i, depth = m.end(), 1 if marker.endswith("(") else 0
                j = i
                while j < len(text):   # to the end of the argument / call
                    c = text[j]
                    depth += c in "([{"
                    depth -= c in ")]}"
                    if depth < 0 or (depth == 0 and c in ",\n" and not marker.endswith("(")):
                        break
                    if depth == 0 and marker.endswith("(") and c == ")":
                        break
                    j += 1
                names.update(re.findall(r'"([a-z_]+)"', text[i:j]))
    return names


def test_rules_table_covers_every_logical_name_in_the_library():
    used = _logical_names_in_source()
    assert {"vocab", "embed", "mlp", "heads", "head_dim", "norm", "act_batch", "act_embed"} <= used
    table = {name for name, _ in sh.LOGICAL_AXIS_RULES}
    assert used <= table, f"logical names without a rule in sharding.LOGICAL_AXIS_RULES: {sorted(used - table)}"


def test_process_rows_single_process():
    mesh = sh.make_mesh()
    assert sh.process_rows(mesh, 16) == (0, 1)
    from transformer_jax.train.distributed import detect_cluster, initialize
    assert initialize() is False or jax.distributed.is_initialized()
    assert detect_cluster() is None
    with pytest.raises(ValueError, match="missing: --coordinator host:port, --process-id i"):
        initialize(num_processes=2)


def test_data_positions_of_several_processes():
    from transformer_jax.train.distributed import local_data_state, merge_data_states
    memory = {"mode": "memory", "epoch": 0, "index": 7}
    assert merge_data_states([memory, memory]) == memory            # any process count resumes it
    assert local_data_state(memory, 1, 4) == memory
    stream = [{"mode": "stream", "doc_pos": i, "process_index": i, "process_count": 2} for i in range(2)]
    merged = merge_data_states(stream)
    assert merged == {"per_process": stream}
    assert [local_data_state(merged, i, 2) for i in range(2)] == stream
    with pytest.raises(ValueError, match="saved by 2 processes .* this run has 4. Resume with 2 processes"):
        local_data_state(merged, 0, 4)


@pytest.mark.parametrize("name, devices, hosts", [
    ("gpt2_124m_tpu_v3_8", 8, 1), ("gpt2_124m_tpu_v4_32", 16, 4),
    ("vit_b16_tpu_v3_8", 8, 1), ("vit_b16_tpu_v4_32", 16, 4)])
def test_scale_out_experiments_fit_their_slices(name, devices, hosts):
    from transformer_jax.models import build_model
    from transformer_jax.train.config import load_experiment
    cfg = load_experiment(name)
    shape = sh.mesh_shape(cfg.mesh, devices)
    split = shape["data"] * shape["fsdp"]
    assert cfg.batch_size % (split * cfg.accum_steps) == 0 and (cfg.batch_size // hosts) % (devices // hosts) == 0
    model_cfg, _ = build_model(cfg.model, cfg.model_preset, cfg.model_overrides)
    if cfg.model == "vit":
        assert model_cfg.num_params() == 86_567_656 and model_cfg.image_size == 224   # ViT-B/16, 1000 classes
    else:
        assert (model_cfg.num_layers, model_cfg.d_model, model_cfg.max_len) == (12, 768, cfg.seq_len)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def workers(data_dir, tmp_path_factory):
    """Starts the parity worker, computes the single-device loss curve here (this process
    has one CPU device; the run also builds the dataset), then starts the curves worker."""
    parity = Worker("parity")
    try:
        assert jax.device_count() == 1
        workdir = tmp_path_factory.mktemp("reference")
        train(apply_overrides(ExperimentConfig(), TINY + [f"data_dir={data_dir}"]), workdir, progress=False)
        root = tmp_path_factory.mktemp("curves")
        curves = Worker("curves", str(root), data_dir)
    except BaseException:
        parity.proc.kill()
        raise
    yield {"parity": parity, "curves": curves, "root": root, "reference": losses(workdir)}
    for w in (parity, curves):
        if w.proc.poll() is None:
            w.proc.kill()


# --------------------------------------------------------------------------- 8 devices

@pytest.mark.slow
def test_meshes_and_pmap_give_single_device_loss_and_gradients(workers):
    """One train step per case (``sharding_worker.CASES``): GPT on the mixed mesh (dropout
    on, with and without gradient accumulation), on data=8, fsdp=8, tensor=8 and pmap; T5 on
    the mixed mesh (dropout on) and pmap; LoRA, CLIP and BERT pretraining as below. Each
    gives one device's loss and gradients; the state's per-device bytes and specs are read
    from the placements of the pure layouts."""
    out = workers["parity"].result()
    assert out["devices"] == 8
    want_cases = {"gpt": ["data=2,fsdp=2,tensor=2", "data=2,fsdp=2,tensor=2/accum2", "data=8 (no dropout)",
                          "fsdp=8 (no dropout)", "pmap (no dropout)", "tensor=8 (no dropout)"],
                  "t5": ["data=2,fsdp=2,tensor=2", "pmap (no dropout)"]}
    for family in ("gpt", "t5"):
        cases = out[family]
        assert sorted(cases) == want_cases[family]
        for case, r in cases.items():
            what = f"{family} {case}: {r}"
            assert r["loss"] < 1e-6 and r["grad_norm"] < 1e-5 and r["grads"] < 1e-5, what
        # parameters + optimizer state per device: data parallel keeps a full copy, 8-way
        # FSDP about an eighth (norm scales and biases stay replicated)
        layouts = out["layouts"][family]
        total = layouts["data=8"]["state_bytes_total"]
        assert cases["pmap (no dropout)"]["state_bytes_total"] == total
        assert layouts["data=8"]["state_bytes_max_device"] == total
        assert cases["pmap (no dropout)"]["state_bytes_max_device"] == total
        assert layouts["fsdp=8"]["state_bytes_max_device"] < total / 6.5
        assert layouts["data=2,fsdp=4"]["state_bytes_max_device"] < total / 3.5
        assert layouts["tensor=8"]["state_bytes_max_device"] < total / 4
    # the jit step's output state keeps the placement's shardings
    for mesh in ("data=8", "fsdp=8", "tensor=8"):
        stepped, placed = out["gpt"][f"{mesh} (no dropout)"], out["layouts"]["gpt"][mesh]
        assert stepped["specs"] == placed["specs"], mesh
        assert stepped["state_bytes_max_device"] == placed["state_bytes_max_device"], mesh
    specs = out["gpt"]["data=2,fsdp=2,tensor=2"]["specs"]
    assert specs["h_0/self_attn/query/kernel"] == "P('fsdp', 'tensor')"
    assert specs["h_0/self_attn/out/kernel"] == "P('tensor', None, 'fsdp')"
    assert specs["h_0/mlp/wo/kernel"] == "P('tensor', 'fsdp')"
    assert specs["wte/embedding"] == "P('tensor', 'fsdp')" and specs["ln_f/scale"] == "P()"
    assert out["t5"]["data=2,fsdp=2,tensor=2"]["specs"]["encoder/relative_attention_bias"] == "P(None, 'tensor')"
    assert out["layouts"]["t5"]["fsdp=8"]["specs"]["encoder/relative_attention_bias"] == "P(None, 'tensor')"
    # LoRA: the adapters' gradients match one device's; each adapter is split like its
    # kernel's input axes (lora_a) or output axes (lora_b), the frozen base like the kernels
    lora = out["gpt_lora"]
    assert sorted(lora) == ["data=2,fsdp=2,tensor=2 (no dropout)", "pmap (no dropout)"]
    for case, r in lora.items():
        assert r["loss"] < 1e-6 and r["grad_norm"] < 1e-5 and r["grads"] < 1e-5, f"lora {case}: {r}"
    specs = lora["data=2,fsdp=2,tensor=2 (no dropout)"]["specs"]
    assert specs["frozen/h_0/self_attn/query/kernel"] == "P('fsdp', 'tensor')"
    assert (specs["h_0/self_attn/query/lora_a"], specs["h_0/self_attn/query/lora_b"]) == \
        ("P('fsdp',)", "P(None, 'tensor')")
    assert specs["frozen/h_0/mlp/wo/kernel"] == "P('tensor', 'fsdp')"
    assert (specs["h_0/mlp/wo/lora_a"], specs["h_0/mlp/wo/lora_b"]) == ("P('tensor',)", "P(None, 'fsdp')")
    assert not any(k.startswith("frozen/") and k.endswith(("lora_a", "lora_b")) for k in specs)
    # CLIP's contrastive loss over the global batch (3 padding rows): a data x fsdp mesh and
    # pmap (which gathers the embeddings itself) give one device's loss and gradients
    clip = out["clip"]
    assert sorted(clip) == ["data=2,fsdp=4 (no dropout)", "pmap (no dropout)"]
    for case, r in clip.items():     # measured: loss 7e-8, grads 7.4e-6 (Zen 4)
        assert r["loss"] < 1e-6 and r["grad_norm"] < 1e-5 and r["grads"] < 3e-5, f"clip {case}: {r}"
    # BERT pretraining's MLM mean over all the batch's masked tokens, unevenly spread over
    # the devices: pmap sums the counts before dividing (under jit the mean is global as written)
    bert = out["bert_pretrain"]
    assert sorted(bert) == ["pmap (no dropout)"]
    for case, r in bert.items():
        assert r["loss"] < 1e-6 and r["grad_norm"] < 1e-5 and r["grads"] < 1e-5, f"bert {case}: {r}"


@pytest.mark.slow
def test_meshes_and_pmap_reproduce_the_single_device_loss_curve(workers):
    """train() on the mixed mesh, on fsdp=8 and with pmap (data=8 runs the second half of
    both resumes, below): the loss curve of one device, step for step."""
    out, reference = workers["curves"].result(), workers["reference"]
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(out["runs"]) == sorted(["fsdp=8", "data=2,fsdp=2,tensor=2", "pmap"])
    for name, got in out["runs"].items():
        want = {s: v for s, v in reference.items() if s <= len(got)}
        assert_curve(got, want, what=name)


@pytest.mark.slow
def test_checkpoints_resume_on_another_mesh(workers, data_dir, tmp_path):
    out, root, reference = workers["curves"].result(), workers["root"], workers["reference"]
    half = STEPS // 2
    assert sorted(out["resumed"]) == ["data=2,fsdp=2,tensor=2 -> data=8", "pmap -> jit data=8"]
    for name, got in out["resumed"].items():
        assert_curve(got, reference, what=name)   # the file reads as one run: rows 1..6
    # 8-way FSDP -> one device (this process): same losses, and the same final parameters
    # as the uninterrupted 8-way FSDP run
    workdir = tmp_path / "fsdp8_to_1"
    shutil.copytree(root / "fsdp=8", workdir)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
    cfg = apply_overrides(ExperimentConfig(), TINY + [f"data_dir={data_dir}"])
    summary = train(cfg, workdir, resume=True, progress=False)
    assert summary["start_step"] == half and summary["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert_curve(losses(workdir), reference, what="fsdp=8 -> 1 device")
    from transformer_jax.train.checkpoint import CheckpointManager
    finals = []
    for d in (workdir, root / "fsdp=8"):
        mgr = CheckpointManager(d / "checkpoints", read_only=True)
        finals.append(mgr.restore(STEPS)[0]["params"])
        mgr.close()
    # (not the attention key biases: their true gradient is zero - softmax ignores them - so
    # Adam, with eps=1e-9, moves them by amplified float noise)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(finals[0])[0],
                            jax.tree_util.tree_leaves(finals[1])):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" not in name:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6, err_msg=name)


# --------------------------------------------------------------------------- 2 processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, data_dir, steps, mesh, *extra):
    port = _free_port()
    sets = [x for s in TINY + [f"data_dir={data_dir}"] for x in ("--set", s)]
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "transformer_jax.cli", "train", "--workdir", str(workdir),
               "--steps", str(steps), "--no-progress", *sets, "--mesh", mesh,
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
               *extra]
        procs.append(subprocess.Popen(cmd, env=env_with_devices(4), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return outs


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume_on_another_mesh(workers, data_dir, tmp_path):
    """2 processes x 4 CPU devices, jax.distributed over localhost with gloo collectives:
    each process reads half of every batch; the run saves, resumes on another mesh, then
    continues here, in one process on one device."""
    workdir = tmp_path / "multi"
    outs = _launch(workdir, data_dir, 2, "data=4,fsdp=2")
    assert '"processes": 2' in outs[0] and '"processes": 2' not in outs[1]   # process 0 reports
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    _launch(workdir, data_dir, 4, "data=2,fsdp=2,tensor=2", "--resume")
    rows = [r for r in read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]   # written once, by process 0
    summary = train(apply_overrides(ExperimentConfig(), TINY + [f"data_dir={data_dir}"]), workdir,
                    resume=True, progress=False)
    assert summary["start_step"] == 4 and summary["processes"] == 1
    assert_curve(losses(workdir), workers["reference"], what="2 processes -> 2 processes -> 1")
