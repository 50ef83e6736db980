"""``transformer-jax compare-torch``: one experiment trained twice, here and in PyTorch, from the
same weights on the same batches, and the two loss curves compared step by step.

The JAX side is the run ``train`` would make (:func:`~transformer_jax.run.setup`:
the task, the model, ``--init-from``, the compiled train step). The PyTorch side is what a
PyTorch user writes (:mod:`transformer_jax.interop.torch_train`): the family's
``transformers`` model (GPT-2, Llama, Mistral, BERT with the run's head, T5, ViT), or the
2017 Transformer as ``torch.nn`` modules, holding the JAX run's initial weights;
``cross_entropy(..., label_smoothing)`` over the task's weights; ``torch.optim.AdamW`` with
weight decay on exactly the parameters that decay here; ``clip_grad_norm_``; the
micro-batches of ``accum_steps``; a ``LambdaLR`` twin of the schedule. Both see the JAX
pipeline's batches, as NumPy.

Both run in float32 with the highest matmul precision and without dropout: dropout masks
are random draws the two frameworks cannot share, so with dropout the runs differ from the
first step. The command says which settings it changed. A setting with no PyTorch twin here
(dynamic loss scaling, LoRA or prefix adapters, a task without a twin) is refused by name.

Writes ``DIR/compare.jsonl`` (a row per step: ``step``, ``loss_jax``, ``loss_torch``,
``grad_norm_jax``, ``grad_norm_torch``, ``lr_jax``, ``lr_torch``, ``ms_jax``, ``ms_torch``)
and ``DIR/compare.png`` (the two loss curves; their relative differences on a log axis), next
to the JAX run's ``config.json``. A difference is ``|a - b| / max(|a|, |b|)``. The learning
rates must agree to :data:`LR_TOLERANCE`, the losses to ``tolerance`` and the gradient norms to
``grad_tolerance`` (the defaults, :data:`DEFAULT_TOLERANCE` and
:data:`DEFAULT_GRAD_TOLERANCE`, come from the drift measured in docs/compare_torch.md: float32
rounding differences, ~1e-7 at the first step, grow as training goes on, and faster in the
gradient norm than in the loss).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from . import storage
from .errors import UserError
from .models import FAMILIES

#: the largest relative loss difference that passes: ~4x the largest drift measured over 30
#: steps of any family's experiment (7.7e-4, the 2017 Transformer; docs/compare_torch.md)
DEFAULT_TOLERANCE = 3e-3
#: the same for the gradient norm (before clipping), which drifts faster (4.6e-2 there)
DEFAULT_GRAD_TOLERANCE = 0.2
#: learning rates: float32 here, float64 in LambdaLR
LR_TOLERANCE = 1e-6

COLUMNS = ("step", "loss_jax", "loss_torch", "grad_norm_jax", "grad_norm_torch", "lr_jax",
           "lr_torch", "ms_jax", "ms_torch")


# ----------------------------------------------------------------------------- the PyTorch forwards

def _lm(model, b):
    return model(input_ids=b["inputs"].long()).logits, b["targets"], b["weights"]


def _mlm(model, b):
    out = model(input_ids=b["input_ids"].long(), attention_mask=b["attention_mask"].long())
    return out.logits, b["targets"], b["weights"]


def _classify(model, b):
    out = model(input_ids=b["input_ids"].long(), token_type_ids=b["token_type_ids"].long(),
                attention_mask=b["attention_mask"].long())
    return out.logits, b["labels"], b["weights"]


def _seq2seq(model, b):
    out = model(input_ids=b["inputs"].long(), attention_mask=b["input_mask"].long(),
                decoder_input_ids=b["targets"].long())
    return out.logits, b["labels"], b["weights"]


def _images(model, b):
    dtype = next(model.parameters()).dtype                        # float32, or float64
    pixels = b["images"].permute(0, 3, 1, 2).to(dtype)           # (B, H, W, C) -> (B, C, H, W)
    return model(pixel_values=pixels).logits, b["labels"], b["weights"]


#: task name -> ``forward(torch_model, batch of tensors) -> (logits, targets, weights)``:
#: the PyTorch twin of the task's loss function's inputs
FORWARDS: dict[str, Callable] = {"lm": _lm, "mlm": _mlm, "classify": _classify,
                                 "seq2seq": _seq2seq, "image_classification": _images}


# ----------------------------------------------------------------------------- the settings

def _model_settings(cfg) -> tuple[str, dict[str, Any]]:
    """The model's family and the settings the run starts from, before this command changes
    them: the checkpoint's with ``init_from``, else the family's defaults and preset; then
    the experiment's ``model.*`` overrides."""
    if cfg.init_from is not None:
        from .train.finetune import load_source
        from .run import check_task

        source = load_source(cfg.init_from)
        check_task(cfg, source)                  # e.g. a BERT checkpoint for a GPT experiment
        family, start = source.family, source.model_config
    else:
        family = cfg.model
        start = FAMILIES[family][0].PRESETS.get(cfg.model_preset, {})
    defaults = {f.name: f.default for f in dataclasses.fields(FAMILIES[family][0])}
    return family, {**defaults, **start, **cfg.model_overrides}


def comparable(cfg) -> tuple[Any, list[str]]:
    """``(cfg, notes)``: ``cfg`` in float32 without dropout (``notes`` say what changed), or a
    UserError naming a setting that has no PyTorch twin here."""
    from .train.config import apply_overrides

    _require_twin(cfg)
    if cfg.parallelism != "jit":
        raise UserError(f"parallelism={cfg.parallelism!r}: compare-torch runs the jit train "
                        "step (the same numbers); drop --set parallelism")
    if cfg.loss_scale == "dynamic":
        raise UserError("loss_scale='dynamic': compare-torch runs float32 without loss scaling "
                        "(torch's GradScaler is not twinned); drop the setting")
    for key in ("lora", "prefix_tokens"):
        if cfg.model_overrides.get(key):
            raise UserError(f"model.{key}={cfg.model_overrides[key]!r}: compare-torch compares "
                            "full training; adapter runs (LoRA, prefix tuning) are not compared "
                            "with PEFT yet; drop the setting")
    family, settings = _model_settings(cfg)
    # every dropout and dtype field is set (a checkpoint brings its own); the notes name those
    # that change
    changes = {f"model.{name}": TWIN_VALUES[_kind(name)] for name in settings if _kind(name)}
    notes = [f"model.{name}={value} -> {changes[f'model.{name}']}"
             for name, value in sorted(_untwinned(settings).items())]
    # with init_from the model is the checkpoint's: its family's fields are the ones to set
    return apply_overrides(cfg.replace(model=family), changes), notes


def _require_twin(cfg) -> None:
    """What no setting mends comes first: a task without a PyTorch twin, then PyTorch itself."""
    if cfg.task not in FORWARDS:
        raise UserError(f"task={cfg.task!r} has no PyTorch twin in compare-torch; it compares "
                        f"the tasks {sorted(FORWARDS)}")
    _require_torch()


def _require_torch() -> None:
    """PyTorch and transformers are the ``torch`` extra; without them, say so before anything runs."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"compare-torch trains the PyTorch side with {' and '.join(missing)}, "
                        "which is not installed; pip install -e \".[torch]\"")


def _check_steps(cfg, steps: int) -> None:
    """The schedule must fit the compared steps (they are the run's steps, so the cosine
    ends with them)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UserError(f"--steps {steps!r} must be a positive integer")
    if cfg.schedule == "warmup_cosine" and cfg.warmup_steps >= steps:
        raise UserError(f"--steps {steps} is not above the experiment's warmup_steps="
                        f"{cfg.warmup_steps} (warmup_cosine decays over the compared steps); "
                        f"add --set warmup_steps={max(1, steps // 6)}, or compare more steps")


#: the value a model field must have for a PyTorch twin, by kind (``_kind``); adapters
#: (``lora``, ``prefix_tokens``) have no twin here and must be absent
TWIN_VALUES = {"dropout": 0.0, "dtype": "float32"}


def _kind(name: str) -> str | None:
    return "dropout" if "dropout" in name else "dtype" if name in ("dtype", "param_dtype") else None


def _untwinned(settings: dict[str, Any]) -> dict[str, Any]:
    """The model settings a PyTorch twin does not share: a dropout rate, a dtype other than
    float32, adapters."""
    return {name: value for name, value in settings.items()
            if (_kind(name) and (value or 0) != TWIN_VALUES[_kind(name)])
            or (name in ("lora", "prefix_tokens") and value)}


def _check_model(model_config) -> None:
    """What ``--init-from`` brings must be comparable too (a checkpoint's own dropout or adapters)."""
    settings = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    bad = [f"{name}={value!r}" for name, value in _untwinned(settings).items()]
    if bad:
        raise UserError(f"the run's model has {', '.join(bad)}, which compare-torch cannot "
                        "twin (it compares float32 runs without dropout or adapters) and the "
                        "--init-from checkpoint fixes; compare a run that starts without them")


# ----------------------------------------------------------------------------- the two runs

def run_jax(cfg, workdir, steps: int):
    """The library's run for ``steps`` updates: ``(module, the PyTorch twin holding its initial
    weights and its decay mask (:func:`torch_twin`), numpy batches, rows)``; rows hold
    ``loss``, ``grad_norm``, ``lr`` and ``ms`` per step. The twin is built before the run
    trains, so that a model PyTorch cannot express is refused first."""
    from .train.loop import fetch
    from .run import setup
    from .train.step import full_params

    with jax.default_matmul_precision("highest"):
        run = setup(cfg, workdir, progress=False)
        try:
            _check_model(run.model.config)
            state = run.state
            params = jax.tree_util.tree_map(np.asarray, fetch(full_params(state)))
            twin = torch_twin(run.model, params)
            batches = [next(run.batches.iterator) for _ in range(steps)]
            rows = []
            for batch in batches:
                start = time.perf_counter()
                state, metrics = run.train_step(state, run.placement.put_batch(batch))
                metrics = fetch(metrics)
                rows.append({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                             "lr": float(metrics["lr"]),
                             "ms": (time.perf_counter() - start) * 1e3})
        finally:
            run.ckpt.close()
            run.writer.close()
    return run.model, twin, run.task.name, batches, rows


def torch_recipe(cfg, model_config, decayed: frozenset):
    """The PyTorch side's optimizer, schedule and loss settings for ``cfg``."""
    from .interop.torch_train import TorchRecipe, lr_lambda

    base_lr, factor = lr_lambda(cfg.schedule, **cfg.schedule_kwargs(model_config.d_model))
    return TorchRecipe(base_lr=base_lr, factor=factor, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm,
                       label_smoothing=cfg.label_smoothing, accum_steps=cfg.accum_steps,
                       decayed=decayed)


def torch_twin(module, params):
    """``(torch model, {parameter name: 1.0 decayed / 0.0 not} as a state dict)``."""
    from .interop import torch_train
    from .train.optim import decay_mask

    from .models.transformer import Transformer

    mask = torch_train.mask_like(params, decay_mask(params))
    if isinstance(module, Transformer):
        return (torch_train.transformer_twin(module, params),
                torch_train.transformer_state_dict(module, mask))
    from .interop.hf import to_hf_numpy
    from .export import hf_architecture

    return torch_train.hf_twin(module, params, hf_architecture(module.config)), \
        to_hf_numpy(module, mask)


def run_torch(cfg, model_config, twin, task: str, batches, *, recipe_hook=None):
    """The rows (``loss``, ``grad_norm``, ``lr``, ``ms``) of the PyTorch ``twin``
    (:func:`torch_twin`'s pair: it trains in place, in its dtype) on ``batches``."""
    from .interop.torch_train import decayed_names, train_step

    model, mask = twin
    recipe = torch_recipe(cfg, model_config, decayed_names(model, mask))
    if recipe_hook is not None:              # tests plant a difference here
        recipe = recipe_hook(recipe, model)
    optimizer, scheduler = recipe.optimizer(model)
    rows = []
    for batch in batches:
        start = time.perf_counter()
        out = train_step(model, optimizer, scheduler, recipe, FORWARDS[task], batch)
        rows.append({**out, "ms": (time.perf_counter() - start) * 1e3})
    return rows


# ----------------------------------------------------------------------------- the comparison

def relative(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 when both are 0; inf when either is not finite)."""
    if not (np.isfinite(a) and np.isfinite(b)):
        return float("inf")
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def _past(row: dict, tolerance: float, grad_tolerance: float) -> list[str]:
    """What in ``row`` is past its tolerance (a non-finite value always is)."""
    limits = {"loss": tolerance, "grad_norm": grad_tolerance, "lr": LR_TOLERANCE}
    return [key for key, limit in limits.items()
            if not relative(row[f"{key}_jax"], row[f"{key}_torch"]) <= limit]


def summarize(rows: list[dict], tolerance: float = DEFAULT_TOLERANCE,
              grad_tolerance: float = DEFAULT_GRAD_TOLERANCE) -> dict[str, Any]:
    """The largest differences, the first step past a tolerance, the speed ratio."""
    def worst(key):
        diffs = [relative(r[f"{key}_jax"], r[f"{key}_torch"]) for r in rows]
        i = int(np.argmax(diffs))
        return diffs[i], rows[i]["step"]

    first = next((r for r in rows if _past(r, tolerance, grad_tolerance)), None)
    timed = rows[1:] or rows                  # the first JAX step compiles
    ms_jax = statistics.median(r["ms_jax"] for r in timed)
    ms_torch = statistics.median(r["ms_torch"] for r in timed)
    (loss, loss_step), (grad, grad_step), (lr, _) = worst("loss"), worst("grad_norm"), worst("lr")
    return {"steps": len(rows), "tolerance": tolerance, "grad_tolerance": grad_tolerance,
            "max_loss_diff": loss,
            "max_loss_diff_step": loss_step, "max_grad_norm_diff": grad,
            "max_grad_norm_diff_step": grad_step, "max_lr_diff": lr,
            "first_step_past": None if first is None else first["step"],
            "past": [] if first is None else _past(first, tolerance, grad_tolerance),
            "within": first is None, "ms_jax": ms_jax, "ms_torch": ms_torch,
            "speed_ratio": ms_torch / ms_jax,
            "bit_identical": all(r["loss_jax"] == r["loss_torch"] for r in rows)}


def describe(summary: dict) -> str:
    s = summary
    lines = [f"largest relative difference over {s['steps']} steps: loss {s['max_loss_diff']:.2e} "
             f"(step {s['max_loss_diff_step']}), grad norm {s['max_grad_norm_diff']:.2e} (step "
             f"{s['max_grad_norm_diff_step']}), learning rate {s['max_lr_diff']:.1e}",
             f"tolerance: loss {s['tolerance']:g}, grad norm {s['grad_tolerance']:g}, learning "
             f"rate {LR_TOLERANCE:g}: "
             + ("within it at every step" if s["within"]
                else f"first passed at step {s['first_step_past']} ({', '.join(s['past'])})"),
             f"speed (median ms/step{', the first step left out' if s['steps'] > 1 else ''}): "
             f"JAX {s['ms_jax']:.1f} on {s.get('jax_device', 'cpu')}, PyTorch "
             f"{s['ms_torch']:.1f} on the CPU: JAX {s['speed_ratio']:.2f}x PyTorch's speed"]
    if "max_loss_jax_vs_f64" in s:
        lines.insert(1, f"against PyTorch in float64: JAX float32 is off by up to loss "
                        f"{s['max_loss_jax_vs_f64']:.2e}, grad norm {s['max_grad_norm_jax_vs_f64']:.2e}; "
                        f"PyTorch float32 by loss {s['max_loss_torch_vs_f64']:.2e}, grad norm "
                        f"{s['max_grad_norm_torch_vs_f64']:.2e}")
    return "\n".join(lines)


def plot(rows: list[dict], tolerances: tuple[float, float], path, title: str) -> None:
    """Both loss curves, and the relative loss and grad-norm differences (log axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(10, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax, dx = fig.subplots(1, 2)
    ax.plot(steps, [r["loss_jax"] for r in rows], label="JAX (this library)", lw=2)
    ax.plot(steps, [r["loss_torch"] for r in rows], "--", label="PyTorch", lw=1.5)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    bottom = 1e-9                             # equal values are drawn here
    for (key, label), tolerance in zip((("loss", "loss"), ("grad_norm", "grad norm")), tolerances):
        diffs = [max(relative(r[f"{key}_jax"], r[f"{key}_torch"]), bottom) for r in rows]
        line, = dx.semilogy(steps, diffs, label=f"{label}: JAX vs PyTorch")
        dx.axhline(tolerance, color=line.get_color(), ls=":", label=f"{label} tolerance")
        if f"{key}_f64" in rows[0]:
            dx.semilogy(steps, [max(relative(r[f"{key}_torch"], r[f"{key}_f64"]), bottom)
                                for r in rows], ls="--", lw=0.8, color=line.get_color(),
                        label=f"{label}: PyTorch float32 vs float64")
    dx.set_ylim(bottom / 2, 1e2)                  # room for the legend above the tolerances
    dx.set(xlabel="step", ylabel="|a - b| / max(|a|, |b|)",
           title=f"relative difference (equal: {bottom:g})")
    dx.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    storage.write_bytes(path, buffer.getvalue())


def _finite(row: dict) -> dict:
    """The row as standard JSON: a NaN or infinite value (a diverged side) becomes null."""
    return {k: v if not isinstance(v, float) or np.isfinite(v) else None for k, v in row.items()}


def _reference(rows: list[dict], reference: list[dict]) -> dict[str, float]:
    """Both float32 runs against PyTorch in float64 (``reference``): ``loss_f64`` and
    ``grad_norm_f64`` added to each row; the largest relative differences of each side."""
    out = {}
    for r, f in zip(rows, reference):
        r["loss_f64"], r["grad_norm_f64"] = f["loss"], f["grad_norm"]
    for key in ("loss", "grad_norm"):
        for side in ("jax", "torch"):
            out[f"max_{key}_{side}_vs_f64"] = max(relative(r[f"{key}_{side}"], r[f"{key}_f64"])
                                                  for r in rows)
    return out


def compare(cfg, workdir, *, steps: int, tolerance: float = DEFAULT_TOLERANCE,
            grad_tolerance: float = DEFAULT_GRAD_TOLERANCE, float64_reference: bool = False,
            say: Callable[[str], None] = print, recipe_hook=None) -> dict[str, Any]:
    """Train ``cfg`` for ``steps`` updates here and in PyTorch; write ``compare.jsonl`` and
    ``compare.png`` into ``workdir``; return :func:`summarize`'s summary (with ``files``).

    ``float64_reference``: train PyTorch once more in float64 (all but the position tables,
    which stay float32 values: the sinusoidal table, HF's RoPE angles), and report how far
    each float32 run strays from it (``loss_f64``,
    ``grad_norm_f64`` in the rows; the ``max_*_vs_f64`` figures): the yardstick for the
    drift between the two. ``recipe_hook(recipe, torch_model) -> recipe`` changes the
    PyTorch side (tests use it to plant a difference the comparison must catch). What
    cannot be compared at all is refused before what a flag mends (``--steps``, a setting)."""
    _require_twin(cfg)
    _check_steps(cfg, steps)
    for flag, value in (("--tolerance", tolerance), ("--grad-tolerance", grad_tolerance)):
        if not value > 0:
            raise UserError(f"{flag} {value!r} must be > 0 (a relative difference)")
    workdir = storage.path(workdir)
    if storage.is_dir(workdir / "checkpoints") and any((workdir / "checkpoints").iterdir()):
        raise UserError(f"--workdir {workdir} holds a training run's checkpoints; compare-torch "
                        "starts a fresh run: choose an empty or new --workdir")
    notes = [f"steps={cfg.steps} -> {steps}"] if cfg.steps != steps else []
    cfg, changed = comparable(cfg.replace(steps=steps))
    notes += changed
    say("compare-torch: float32, highest matmul precision, no dropout (dropout masks are random "
        "draws the two frameworks cannot share)" + (f"; changed: {', '.join(notes)}" if notes else ""))
    module, (model, mask), task, batches, jax_rows = run_jax(cfg, workdir, steps)
    reference = copy.deepcopy(model).double() if float64_reference else None   # untrained
    say(f"JAX: {steps} steps done; PyTorch: training the same weights on the same batches")
    torch_rows = run_torch(cfg, module.config, (model, mask), task, batches,
                           recipe_hook=recipe_hook)
    rows = [{"step": i + 1, **{f"{key}_{side}": r[key] for key in ("loss", "grad_norm", "lr", "ms")
                               for side, r in (("jax", a), ("torch", b))}}
            for i, (a, b) in enumerate(zip(jax_rows, torch_rows))]      # in COLUMNS' order
    extra = {}
    if reference is not None:
        say("PyTorch again, in float64: the reference both float32 runs are measured against")
        extra = _reference(rows, run_torch(cfg, module.config, (reference, mask), task, batches,
                                           recipe_hook=recipe_hook))
    storage.write_text(workdir / "compare.jsonl", "".join(json.dumps(_finite(r)) + "\n" for r in rows))
    plot(rows, (tolerance, grad_tolerance), workdir / "compare.png",
         f"{cfg.name}: {cfg.model}, {task}")
    summary = {**summarize(rows, tolerance, grad_tolerance), **extra,
               "jax_device": jax.devices()[0].platform}
    summary["files"] = [str(workdir / "compare.jsonl"), str(workdir / "compare.png")]
    return summary
