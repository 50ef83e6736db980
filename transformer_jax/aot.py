"""Ahead-of-time compilation of an experiment for a TPU slice, on any host.

``transformer-jax compile --experiment NAME --tpu v5e-8`` builds the experiment's real
train step (or its eval step, or the decode loop of ``generate``), shards it over a mesh
of the slice's devices as a run would (``--mesh``, default the experiment's), and has the
TPU compiler (libtpu, ``pip install 'transformer_jax[tpu]'``) compile it for that slice on
this host: no TPU, no data (the batch is described by the task, :meth:`Task.batch_shapes`;
a tokenizer trained from the data counts as its configured vocabulary size). What the
compiler reports is what the hardware would need:

  per device  arguments (parameters, optimizer state, batch), temporaries, outputs, and
              the total against the generation's HBM (fits, headroom);
  program     the collectives it runs per step (count and bytes), the attention path the
              generation takes and the Mosaic kernels in it;
  time        the compile time; the roofline of the compiled program, a *lower bound* on
              its time per device: the slower of its FLOPs at the generation's bf16 peak
              and its HBM bytes at its bandwidth (:mod:`.hlo` counts both from the HLO,
              loop bodies times their trip counts), which one binds, and its FLOPs against
              the model FLOPs (6N + attention; over a frozen base, LoRA or QLoRA, 4 per
              frozen weight and 6 per trained one); and the older estimate: the model
              FLOPs at a stated MFU (for the decode loop, the prefill at the MFU, then each
              token reading the parameters and KV cache from HBM), never below the
              roofline (the bound is printed as the estimate where it would be). Neither
              is a measurement.

:func:`compile_experiment` returns a :class:`CompileReport`; :func:`collectives` reads the
collectives from a compiled program's HLO text, loops counted by their trip counts.
"""
from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from typing import Any

import jax

from . import sharding as sh
from .hlo import collectives, costs
from .errors import UserError
from .layers.attention_dispatch import tpu_generation_of
from .models.base import attention_plan
from .tasks import make_task
from .tpu import GENERATIONS, GIB, TpuSlice
from .train import finetune
from .train.config import ExperimentConfig
from .run import build, make_loss_scale, make_tx
from .train.step import create_train_state, eval_step, make_train_step

WHAT = ("train", "eval", "decode")
DEFAULT_MFU = 0.4
DECODE_TOKENS = 64     # what --what decode generates by default (fewer for a short model)


@dataclasses.dataclass
class CompileReport:
    """What the TPU compiler said about one program on one slice (bytes per device)."""
    experiment: str
    what: str
    tpu: str
    topology: str
    devices: int
    hosts: int
    mesh: str
    attention: str
    mosaic_kernels: int
    parameter_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    per_device_bytes: int
    hbm_bytes: int
    compile_seconds: float
    collectives: dict[str, dict[str, int]]
    flops_per_step: float
    mfu: float
    estimated_step_seconds: float
    notes: list[str] = dataclasses.field(default_factory=list)
    out_of_memory: bool = False     # the compiler refused it for HBM
    estimate_basis: str = ""        # what estimated_step_seconds is computed from
    flops_convention: str = ""      # how flops_per_step counts (PaLM's 6N, a frozen base's 4N)
    decode_shape: dict | None = None   # --what decode: batch, prompt_len, new_tokens, max_len
    levers: list[str] = dataclasses.field(default_factory=list)   # what lowers the need
    attention_why: str = ""         # why "auto" took that attention path
    # the roofline of the compiled program (per device, loops times their trip counts):
    compiled_flops: float = 0.0      # its matmul FLOPs (hlo.costs)
    compiled_hbm_bytes: float = 0.0  # its HBM bytes read and written
    roofline_seconds: float = 0.0    # max(FLOPs / peak, bytes / bandwidth): a lower bound
    roofline_bound: str = ""         # "compute" or "memory": which term binds
    flops_ratio: float = 0.0         # compiled FLOPs x devices / model FLOPs

    @property
    def fits(self) -> bool:
        return not self.out_of_memory and self.per_device_bytes <= self.hbm_bytes

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        return out

    def describe(self) -> str:
        """The report as a few readable lines (the CLI prints them)."""
        g = _size
        head = self.hbm_bytes - self.per_device_bytes
        lines = [
            f"{self.experiment} ({self.what} step) on {self.tpu}: {self.devices} devices, "
            f"{self.hosts} host(s), topology {self.topology}, mesh {self.mesh}",
            f"attention: {self.attention} ({self.mosaic_kernels} Mosaic kernel call(s) "
            "in the program" + (f"; {self.attention_why})" if self.attention_why else ")"),
        ]
        if self.decode_shape:
            d = self.decode_shape
            lines.append(f"decode: batch {d['batch']}, prompts of {d['prompt_len']} tokens, "
                         f"{d['new_tokens']} tokens generated (model max_len {d['max_len']})")
        aliased = (f" ({g(self.alias_bytes)} of them written over donated arguments: "
                   "counted once, as arguments)") if self.alias_bytes else ""
        lines += [
            f"per device: arguments {g(self.argument_bytes)} (parameters "
            f"{g(self.parameter_bytes)}, optimizer state {g(self.optimizer_bytes)}, batch "
            f"{g(self.batch_bytes)}), temporaries {g(self.temp_bytes)}, outputs "
            f"{g(self.output_bytes)}{aliased}",
            f"total {g(self.per_device_bytes)} of {g(self.hbm_bytes)} HBM: "
            + (f"fits, {g(head)} headroom ({head / self.hbm_bytes:.0%})" if self.fits
               else f"does NOT fit, {g(max(0, -head))} over"),
            "collectives per step: " + (", ".join(
                f"{k} x{v['count']} ({v['bytes'] / 2**20:.1f} MiB)"
                for k, v in self.collectives.items()) or "none"),
            self.roofline_line(),
            f"model FLOPs per step {self.flops_per_step:.3g}"
            + (f" ({self.flops_convention})" if self.flops_convention else "") + "; estimated "
            f"{'decode' if self.decode_shape else 'step'} time "
            f"{_ms(self.estimated_step_seconds)} ({self.estimate_basis}; an estimate, "
            "not a measurement)",
            f"compiled in {self.compile_seconds:.1f} s",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def roofline_line(self) -> str:
        """The compiled program's roofline: a lower bound on its time, not a measurement."""
        if not self.compiled_flops:
            return "roofline: none (the compiler gave no program, only its memory need)"
        return (f"roofline (a lower bound on the {'decode' if self.decode_shape else 'step'} "
                f"time, not a measurement): {_ms(self.roofline_seconds)}, "
                f"{self.roofline_bound}-bound; per device {self.compiled_flops:.3g} FLOPs "
                f"and {_size(int(self.compiled_hbm_bytes))} of HBM traffic in the compiled "
                f"program; compiled / model FLOPs {self.flops_ratio:.2f}")

    def not_fit_message(self) -> str:
        return (f"{self.experiment} needs {self.per_device_bytes / GIB:.2f} GiB per device on "
                f"{self.tpu} (mesh {self.mesh}), which has {self.hbm_bytes / GIB:.0f} GiB HBM "
                f"per device; {', '.join(self.levers) or 'take a larger slice'}")


def _size(n: int) -> str:
    for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.2f} GiB" if unit == GIB else f"{n / unit:.1f} {name}"
    return f"{n} B"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3g} ms"


def levers(cfg: ExperimentConfig, model_cfg, tpu: TpuSlice, mesh_shape: dict,
           what: str) -> list[str]:
    """What would lower the memory per device, by real flags and config fields: the mesh
    only where it has more than one device to shard over, remat and the optimizer state
    only for a train step, the larger slices and generations there are."""
    out = []
    sharded = mesh_shape.get("fsdp", 1) * mesh_shape.get("tensor", 1)
    if tpu.devices > 1 and sharded < tpu.devices:
        state = "parameters and optimizer state" if what == "train" else "parameters"
        out.append(f"shard the {state} over the devices (--mesh fsdp=-1)")
    if what == "train" and not getattr(model_cfg, "remat", True):
        out.append("rematerialise the layers (--set model.remat=true)")
    micro = cfg.batch_size // cfg.accum_steps
    if micro > 1:
        out.append("lower the batch (--set batch_size=N" + (
            ", or --set accum_steps=N for the same batch in micro-batches)"
            if what == "train" else ")"))
    if what == "decode":
        out.append("generate fewer tokens (--decode-tokens N)")
    if str(getattr(model_cfg, "param_dtype", "")) == "float32":
        state = "parameters and AdamW moments" if what == "train" else "parameters"
        out.append(f"keep the {state} in bf16 (--set model.param_dtype=bfloat16)")
    bigger = [g.name for g in GENERATIONS.values() if g.hbm_bytes > tpu.hbm_bytes]
    out.append(f"or take a larger slice (--tpu {tpu.next_larger().name} with --mesh fsdp=-1)"
               + (f" or chips with more HBM ({', '.join(bigger)})" if bigger else ""))
    return out


# ----------------------------------------------------------------------------- the task

def _planned_task(cfg: ExperimentConfig, workdir: str):
    """``(task, model_overrides)`` without reading data: the task is built from the config
    alone (:meth:`Task.planned_spec`: an image dataset's classes and channels are the model
    config's, its metadata is not opened), and a SentencePiece vocabulary still to be
    trained from the data counts as its configured size (the task is built on the byte
    tokenizer, and the vocabulary it derives moves by the difference)."""
    if cfg.tokenizer != "sentencepiece":
        task = make_task(cfg, workdir, plan=True)
        return task, task.model_overrides()
    from .data import get_tokenizer

    task = make_task(dataclasses.replace(cfg, tokenizer="byte"), workdir, plan=True)
    overrides = dict(task.model_overrides())
    if "vocab_size" in overrides:
        overrides["vocab_size"] += cfg.sentencepiece_vocab_size - get_tokenizer("byte").vocab_size
    return task, overrides


def _planned_note(cfg: ExperimentConfig, task, overrides: dict) -> list[str]:
    """The note that says the data's shapes are the config's, where the dataset was not
    opened (a task built from its planned spec)."""
    if task.saved_spec is None:
        return []
    fields = ", ".join(f"{k}={v}" for k, v in overrides.items() if k.startswith("num_"))
    return [f"dataset {cfg.dataset!r} not opened: its shapes are the model config's ({fields}; "
            "--set model.FIELD=N where the data's differ)"]


# ----------------------------------------------------------------------------- compiling

def _per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of a tree of abstract arrays under ``shardings`` (the most
    loaded device: shards of indivisible dims are replicated)."""
    return sum(_leaf_bytes(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)) for a, s in
               zip(jax.tree_util.tree_leaves(abstract_tree), jax.tree_util.tree_leaves(shardings)))


def _leaf_bytes(a) -> int:
    """Bytes one device holds of an abstract array (its shard, or all of it unsharded)."""
    sharding = getattr(a, "sharding", None)
    shape = sharding.shard_shape(a.shape) if hasattr(sharding, "shard_shape") else a.shape
    n = a.dtype.itemsize
    for d in shape:
        n *= d
    return n


def _tree_bytes(tree) -> int:
    return sum(_leaf_bytes(a) for a in jax.tree_util.tree_leaves(tree))


def _mesh_for(cfg: ExperimentConfig, tpu: TpuSlice, mesh_spec: str | None):
    devices = tpu.jax_devices()
    spec = cfg.mesh if mesh_spec is None else mesh_spec
    try:
        return sh.make_mesh(spec, devices=devices)
    except UserError as e:
        raise UserError(f"--mesh for {tpu.name} ({len(devices)} devices): {e}") from None


def _check_batch(cfg: ExperimentConfig, mesh) -> None:
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.accum_steps
    if micro % split:
        raise UserError(f"batch_size={cfg.batch_size} (accum_steps={cfg.accum_steps}) does not "
                        f"split over data x fsdp = {split} devices of mesh {sh.describe(mesh)}; "
                        f"use a batch_size that is a multiple of {split * cfg.accum_steps}")


def _state_and_step(cfg, task, model_cfg, model, mesh, what: str, decode_tokens: int | None):
    """``(jitted function, abstract arguments, (parameter, optimizer, batch) bytes, notes,
    the decode shape or None, the parameters that train over a frozen base or None)``
    (the last: ``finetune.trainable_counts``, for the model FLOPs)."""
    rng = jax.random.PRNGKey(cfg.seed)
    init_args = task.init_args()
    tx, schedule = make_tx(cfg, model_cfg)
    split = finetune.make_split(model_cfg, None, cfg.model)
    create_state = lambda: create_train_state(  # noqa: E731
        model, tx, rng, *init_args, loss_scale=make_loss_scale(cfg, model_cfg),
        partition=None if split is None else split.split)
    abstract, shardings, notes = sh.train_state_shardings(
        create_state, lambda: model.init(rng, *init_args), mesh)
    adapted = finetune.trainable_counts(split, abstract.params)
    params_bytes = _per_device_bytes((abstract.params, abstract.frozen),
                                     (shardings.params, shardings.frozen))
    opt_bytes = _per_device_bytes(abstract.opt_state, shardings.opt_state)
    batch_sh = sh.batch_sharding(mesh)
    rep = sh.replicated(mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh)
             for k, v in task.batch_shapes().items()}
    batch_bytes = _tree_bytes(batch)
    if what == "train":
        step = make_train_step(loss_fn=task.loss_fn, label_smoothing=cfg.label_smoothing,
                               accum_steps=cfg.accum_steps, schedule=schedule,
                               loss_chunk=cfg.loss_chunk)
        fn = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, rep),
                     donate_argnums=(0,))
        return fn, (sh.with_shardings(abstract, shardings), batch), \
            (params_bytes, opt_bytes, batch_bytes), notes, None, adapted
    param_sh = _whole_param_shardings(abstract, shardings, split)
    params = sh.with_shardings(_whole_params(abstract, split), param_sh)
    if what == "eval":
        fn = jax.jit(lambda p, b: eval_step(p, b, model.apply, task.loss_fn),
                     in_shardings=(param_sh, batch_sh), out_shardings=rep)
        return fn, (params, batch), (params_bytes, 0, batch_bytes), notes, None, adapted
    fn, args, shape = _decode_step(cfg, model, params, param_sh, mesh, decode_tokens)
    return fn, args, (params_bytes, 0, _tree_bytes(args[1:])), notes, shape, adapted


def _whole_params(abstract, split):
    if split is None or abstract.frozen is None:
        return abstract.params
    return jax.eval_shape(split.join, abstract.params, abstract.frozen)


def _whole_param_shardings(abstract, shardings, split):
    if split is None or abstract.frozen is None:
        return shardings.params
    whole = jax.eval_shape(split.join, abstract.params, abstract.frozen)
    flat = {}
    for tree, shs in ((abstract.params, shardings.params), (abstract.frozen, shardings.frozen)):
        for (path, _), s in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                                jax.tree_util.tree_leaves(shs)):
            flat[path] = s
    rep = jax.tree_util.tree_leaves(shardings.params)[0]
    return jax.tree_util.tree_map_with_path(lambda p, _: flat.get(p, rep), whole)


def decode_shape(cfg: ExperimentConfig, model_cfg, new_tokens: int | None) -> dict:
    """``{batch, prompt_len, new_tokens, max_len}`` of the decode loop compiled: a batch of
    ``batch_size`` prompts that with the new tokens fill ``seq_len`` (at least one prompt
    token). ``new_tokens`` None: 64, or half of ``seq_len`` / ``max_len`` when shorter."""
    from .decode import decodes_past_max_len

    max_len = getattr(model_cfg, "max_len", None)
    room = min(cfg.seq_len, max_len or cfg.seq_len)
    if new_tokens is None:
        new_tokens = min(DECODE_TOKENS, max(1, room // 2))
    elif new_tokens < 1:
        raise UserError(f"--decode-tokens {new_tokens}: generate at least 1 token")
    prompt_len = max(1, room - new_tokens)
    if (max_len is not None and prompt_len + new_tokens > max_len
            and not decodes_past_max_len(model_cfg)):
        raise UserError(f"--decode-tokens {new_tokens} does not fit the model's max_len "
                        f"{max_len} (with a prompt of at least 1 token); give --decode-tokens "
                        f"{max_len - 1} or fewer, or a longer model (--set model.max_len=N)")
    return dict(batch=cfg.batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                max_len=max_len)


def _decode_step(cfg, model, params, param_sh, mesh, new_tokens: int | None):
    """The decode loop of ``generate`` (prefill + ``new_tokens`` sampled tokens) for a
    batch of prompts (:func:`decode_shape`): ``(jitted function, arguments, shape)``."""
    from .decode import jitted_generate

    if cfg.task != "lm":
        raise UserError(f"--what decode compiles the KV-cache loop of a language model; "
                        f"{cfg.name!r} is a {cfg.task!r} experiment (use --what train or eval)")
    shape = decode_shape(cfg, model.config, new_tokens)
    new_tokens = shape["new_tokens"]
    batch_sh = sh.batch_sharding(mesh)
    rep = sh.replicated(mesh)
    prompt = jax.ShapeDtypeStruct((shape["batch"], shape["prompt_len"]), "int32",
                                  sharding=batch_sh)

    def decode(p, ids, rng):
        mask = jax.numpy.ones_like(ids)
        return jitted_generate(model, p, ids, mask, rng, 1.0, 1.0, max_new_tokens=new_tokens,
                               greedy=False, top_k=40, use_top_p=False, eos_id=None, pad_id=0)

    key = jax.ShapeDtypeStruct((2,), "uint32", sharding=rep)
    fn = jax.jit(decode, in_shardings=(param_sh, batch_sh, rep), out_shardings=batch_sh)
    return fn, (params, prompt, key), shape


def decode_estimate(model, model_cfg, params, shape: dict, tpu: TpuSlice, mesh_shape: dict,
                    mfu: float) -> tuple[float, float, str]:
    """``(model FLOPs, seconds, basis)`` of the decode loop, a roofline: the prefill at
    ``mfu`` of the bf16 peak, then each new token the slower of its FLOPs at ``mfu`` and
    its HBM reads at the generation's bandwidth: every device reads its share of the
    parameters (all of each weight its ``tensor`` shard keeps: fsdp gathers the rest) and
    of the KV cache (as long as prompt + new tokens, split over the mesh)."""
    from .decode import init_cache

    b, p, n = shape["batch"], shape["prompt_len"], shape["new_tokens"]
    forward = model_cfg.flops_per_token(p + n) / 3           # 2N of the 6N per token
    compute = tpu.devices * tpu.peak_bf16 * mfu
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize  # noqa: E731
                              for a in jax.tree_util.tree_leaves(tree))
    param_read = nbytes(params) / mesh_shape.get("tensor", 1)
    cache = nbytes(jax.eval_shape(lambda: init_cache(model, b, p + n))) / tpu.devices
    per_token_memory = (param_read + cache) / tpu.hbm_bandwidth
    per_token = max(per_token_memory, forward * b / compute)
    prefill = forward * b * p / compute
    bound = (f"memory-bound: {_size(int(param_read + cache))} read per device per token "
             f"(parameters {_size(int(param_read))}, KV cache {_size(int(cache))}) at "
             f"{tpu.hbm_bandwidth / 1e12:.3g} TB/s HBM" if per_token == per_token_memory else
             f"compute-bound at {mfu:.0%} MFU")
    basis = (f"prefill of {b}x{p} tokens at {mfu:.0%} MFU {_ms(prefill)}, then {n} tokens of "
             f"{_ms(per_token)} each, {bound}")
    return forward * b * (p + n), prefill + n * per_token, basis


def compile_experiment(cfg: ExperimentConfig, tpu: TpuSlice | str, *, mesh: str | None = None,
                       what: str = "train", mfu: float = DEFAULT_MFU,
                       decode_tokens: int | None = None) -> CompileReport:
    """Compile ``cfg``'s ``what`` step ("train", "eval" or "decode") for the slice ``tpu``
    on this host; see the module docstring. A program that does not fit is still reported
    (``report.fits`` False); a compile failure other than memory is a UserError.
    ``decode_tokens``: the tokens ``--what decode`` generates (None: :func:`decode_shape`)."""
    tpu = TpuSlice.parse(tpu) if isinstance(tpu, str) else tpu
    if what not in WHAT:
        raise UserError(f"--what {what!r}: choose one of {WHAT}")
    if cfg.init_from is not None:
        raise UserError("compile builds an experiment's model from its config; an --init-from "
                        "run takes its model from the checkpoint: compile an experiment with "
                        "the same model preset instead")
    if cfg.parallelism != "jit":
        raise UserError("compile builds the jit placement (one sharded program); drop "
                        "--parallelism pmap (pmap programs are per device, with the same memory "
                        "as data=-1)")
    device_mesh = _mesh_for(cfg, tpu, mesh)
    _check_batch(cfg, device_mesh)
    with tempfile.TemporaryDirectory(prefix="transformer_jax_compile_") as workdir:
        task, overrides = _planned_task(cfg, workdir)
        model_cfg, model = build(cfg, overrides)
        generation = tpu_generation_of(device_mesh.devices.flat[0].device_kind)
        plan = attention_plan(model_cfg, cfg.seq_len, "tpu", generation)
        fn, args, (p_bytes, o_bytes, b_bytes), notes, shape, adapted = _state_and_step(
            cfg, task, model_cfg, model, device_mesh, what, decode_tokens)
        notes = _planned_note(cfg, task, overrides) + notes
        start = time.perf_counter()
        with sh.use_mesh(device_mesh):
            lowered = fn.trace(*args).lower()
            compiled, oom = _compile(lowered, tpu)
        seconds = time.perf_counter() - start
        mesh_shape = dict(device_mesh.shape)
        if what == "decode":
            flops, seconds_est, basis = decode_estimate(model, model_cfg, args[0], shape, tpu,
                                                        mesh_shape, mfu)
        else:
            flops = task.flops_per_step(model_cfg, adapted) if what == "train" else (
                task.flops_per_step(model_cfg) / 3)          # forward only: 2N of 6N
            seconds_est = flops / (tpu.devices * tpu.peak_bf16 * mfu)
            basis = (f"model FLOPs / ({tpu.devices} devices x {tpu.peak_bf16 / 1e12:.3g} "
                     f"TFLOP/s bf16 x {mfu:.0%} MFU)")
    arg, temp, out, alias = memory_figures(compiled, lowered, args)
    if oom:
        notes = [f"the compiler: {oom[:300]}", *notes]
    key = "eval" if what != "train" else "train"
    attention = f"{plan[key]} (tpu {tpu.generation.name})"
    why = plan["why"] if plan[key] == plan["eval"] else "attention dropout"
    text = compiled.as_text()
    roofline = roofline_figures(costs(text), tpu, flops)
    if seconds_est < roofline["roofline_seconds"]:     # no estimate below its lower bound
        basis = (f"the roofline bound: {basis} gives {_ms(seconds_est)}, below the bound")
        seconds_est = roofline["roofline_seconds"]
    return CompileReport(
        experiment=cfg.name, what=what, tpu=tpu.name, topology=tpu.topology, devices=tpu.devices,
        hosts=tpu.hosts, mesh=sh.describe(device_mesh), attention=attention, attention_why=why,
        mosaic_kernels=lowered.as_text().count("tpu_custom_call"), parameter_bytes=p_bytes,
        optimizer_bytes=o_bytes, batch_bytes=b_bytes, argument_bytes=arg, temp_bytes=temp,
        output_bytes=out, alias_bytes=alias, per_device_bytes=arg + temp + out - alias,
        hbm_bytes=tpu.hbm_bytes, compile_seconds=seconds,
        collectives=collectives(text), flops_per_step=flops, mfu=mfu,
        estimated_step_seconds=seconds_est, notes=notes[:4], out_of_memory=bool(oom),
        estimate_basis=basis, decode_shape=shape, flops_convention=_convention(what, adapted),
        levers=levers(cfg, model_cfg, tpu, mesh_shape, what), **roofline)


def _convention(what: str, adapted: tuple[int, int] | None) -> str:
    """How the model FLOPs of a ``what`` step count (``Task.flops_per_step``)."""
    if what == "decode":
        return "forward: 2 per weight per token, plus attention"
    if what == "eval":
        return "forward: 2 per weight per token, plus attention (a third of 6N)"
    if adapted is None:
        return "6 per weight per token (forward, input and weight gradients), plus attention"
    return ("a frozen base: 4 per frozen weight per token (forward and input gradient, no "
            "weight gradient), 6 per trained one (adapters, head), plus attention")


def roofline_figures(cost: dict, tpu: TpuSlice, model_flops: float) -> dict:
    """The report's roofline fields from a compiled program's per-device ``{"flops",
    "bytes"}`` (:func:`hlo.costs`): the bound is the slower of its FLOPs at the generation's
    bf16 peak and its HBM bytes at its bandwidth, per device."""
    compute, memory = cost["flops"] / tpu.peak_bf16, cost["bytes"] / tpu.hbm_bandwidth
    return dict(compiled_flops=cost["flops"], compiled_hbm_bytes=cost["bytes"],
                roofline_seconds=max(compute, memory),
                roofline_bound="compute" if compute >= memory else "memory",
                flops_ratio=cost["flops"] * tpu.devices / model_flops if model_flops else 0.0)


def memory_figures(compiled, lowered, args) -> tuple[int, int, int, int]:
    """``(arguments, temporaries, outputs, aliased)`` bytes per device, as the compiler's
    ``memory_analysis()`` gives them. Where it gave only its total need (:class:`_OverMemory`),
    arguments and outputs come from the program's shapes and shardings, the outputs written
    over donated arguments count as aliased (as the compiler counts them), and temporaries
    are the rest, so that arguments + temporaries + outputs - aliased is the need."""
    mem = compiled.memory_analysis()
    figures = (int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes),
               int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes))
    if not isinstance(compiled, _OverMemory):
        return figures
    arg = _tree_bytes(args)
    out, alias = _output_bytes(lowered, args)
    return arg, max(0, compiled.need - arg - out + alias), out, alias


def _output_bytes(lowered, args) -> tuple[int, int]:
    """``(outputs, aliased)`` bytes per device of a lowered program: each output of the
    shape, dtype and shard of a donated argument takes that argument's buffer."""
    outs = jax.tree_util.tree_leaves(lowered.out_info)
    infos = jax.tree_util.tree_leaves(lowered.args_info)
    leaves = jax.tree_util.tree_leaves(args)
    key = lambda a: (tuple(a.shape), str(a.dtype), _leaf_bytes(a))  # noqa: E731
    donated: dict = {}
    if len(infos) == len(leaves):
        for info, a in zip(infos, leaves):
            if info.donated:
                donated[key(a)] = donated.get(key(a), 0) + 1
    alias = 0
    for o in outs:
        if donated.get(key(o), 0) > 0:
            donated[key(o)] -= 1
            alias += _leaf_bytes(o)
    return sum(_leaf_bytes(o) for o in outs), alias


def _compile(lowered, tpu: TpuSlice) -> tuple[Any, str]:
    """``(compiled, out-of-memory message or "")``. When the program does not fit, XLA:TPU
    compiles it again without failing on HBM (``xla_tpu_no_crash_on_oom``) so that the
    report has the memory it needs; failing that, the need its message states. Any other
    failure is a UserError."""
    try:
        return lowered.compile(), ""
    except Exception as e:  # noqa: BLE001 - XLA raises XlaRuntimeError/ValueError variants
        text = str(e)
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            raise UserError(f"the TPU compiler failed for {tpu.name}: {first[:400]}") from None
    try:
        return lowered.compile({"xla_tpu_no_crash_on_oom": True}), first
    except Exception:  # noqa: BLE001 - this program's OOM is not one XLA can step over
        return _OverMemory(text), first


class _OverMemory:
    """Stands in for a compiled program when XLA only says how much it needs."""

    def __init__(self, error: str):
        unit = {"T": 1024 * GIB, "G": GIB, "M": 2**20, "K": 2**10, "": 1}
        need = re.search(r"required[^(]*\(([\d.]+)([TGMK]?)i?B?\)", error)
        self.need = int(float(need.group(1)) * unit[need.group(2)]) if need else 0

    def memory_analysis(self):
        return _Memory(0, self.need, 0, 0)

    def as_text(self) -> str:
        return ""


@dataclasses.dataclass
class _Memory:
    argument_size_in_bytes: int
    temp_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
