"""``transformer-jax``: train, eval and generate from the command line.

  transformer-jax train [--experiment NAME|FILE] [--workdir DIR] [--steps N] [--resume | --resume-from STEP] [--set k=v ...]
                        [--init-from HF_DIR|WORKDIR]
                        [--parallelism jit|pmap] [--mesh data=N,fsdp=N,tensor=N]
                        [--coordinator HOST:PORT --num-processes N --process-id I]
  transformer-jax eval --workdir DIR [--batches N]
  transformer-jax eval --tasks A,B (--workdir DIR | --init-from DIR) [--include-path DIR] [--num-fewshot K] [--dtype bfloat16] [--mesh fsdp=-1]
                       [--limit N] [--batch-size B] [--bootstrap-iters N] [--output OUT.json]
  transformer-jax generate --workdir DIR --prompt TEXT --max-new-tokens N [--temperature T] [--top-k K] [--top-p P] [--seed S]
  transformer-jax export --workdir DIR --out DIR [--format hf|peft] [--merge]
  transformer-jax sweep --experiment NAME|FILE --workdir DIR [--quick] [--parallel N] [--set k=v ...]
  transformer-jax compile --experiment NAME --tpu TYPE|--topology NAME [--mesh M] [--what train|eval|decode]
                          [--decode-tokens N] [--set k=v ...] [--mfu F] [--json]
  transformer-jax compare-torch [--experiment NAME|FILE] [--workdir DIR] [--steps N] [--set k=v ...]
                                [--init-from DIR] [--tolerance T] [--grad-tolerance G] [--float64-reference]
  transformer-jax experiments

This module parses flags and reports errors; the work happens in ``transformer_jax.run``
(``train``) and the modules it names. A
``train --resume`` (or ``--resume-from``) starts from the settings of the run in ``--workdir``
(its ``config.json``, :func:`~transformer_jax.train.resume.resume_settings`), not from the
experiment's: ``--set`` and ``--steps`` apply on top of them.
User mistakes (:class:`~transformer_jax.errors.UserError`: a bad flag, config or workdir,
an empty dataset) and file errors the user fixes (a full, read-only or forbidden disk) are
printed as one ``error:`` line with exit status 2, a non-finite loss with exit status 3;
anything else is a bug and shows its traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transformer-jax", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: a small GPT on the embedded Python-stdlib corpus)")
    t.add_argument("--experiment", default=None, help="experiment name in experiments/ or a path to one")
    t.add_argument("--workdir", default=None, help="run directory (default: runs/<experiment name>)")
    t.add_argument("--steps", type=int, default=None, help="total training steps (overrides the config)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --workdir, with the run's settings "
                        "(its config.json; --set and --steps change them)")
    t.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                   help="continue from checkpoint STEP (any kept one); later ones move to STEP.superseded")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from a Hugging Face save_pretrained directory or a "
                        "transformer_jax workdir (its model config and tokenizer)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field; model fields as model.FIELD=VALUE (repeatable)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--parallelism", choices=("jit", "pmap"), default=None,
                   help="jit: one sharded jit over --mesh (default); pmap: replicated data parallelism")
    t.add_argument("--mesh", default=None, metavar="data=N,fsdp=N,tensor=N",
                   help="device mesh for --parallelism jit; omitted axes are 1, one axis may be -1 "
                        "(the remaining devices); default: all devices on data")
    t.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: address of process 0 (also $TRANSFORMER_JAX_COORDINATOR; "
                        "TPU pods, SLURM and mpirun are detected without it)")
    t.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="multi-process run: number of processes (also $TRANSFORMER_JAX_NUM_PROCESSES)")
    t.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="multi-process run: this process's index, 0..N-1 (also $TRANSFORMER_JAX_PROCESS_ID)")

    _add_eval_parser(sub)

    g = sub.add_parser("generate", help="generate text with the latest checkpoint of a workdir")
    g.add_argument("--workdir", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)

    x = sub.add_parser("export", help="write a run as a Hugging Face directory (or its adapter "
                                      "as a PEFT directory)")
    x.add_argument("--workdir", required=True)
    x.add_argument("--out", required=True, help="a new (or empty) directory")
    x.add_argument("--format", choices=("hf", "peft"), default="hf",
                   help="hf: safetensors + config.json + tokenizer (AutoModel*.from_pretrained); "
                        "peft: the LoRA or prefix adapter (PeftModel.from_pretrained)")
    x.add_argument("--merge", action="store_true",
                   help="fold a LoRA run's adapters into the kernels (with --format hf)")

    s = sub.add_parser("sweep", help="run an experiment's grid of runs (e.g. scaling_laws) and "
                                     "its analysis; started again, it continues")
    s.add_argument("--experiment", required=True, help="an experiment that defines a grid "
                                                         "(SWEEP or get_sweep), by name or path")
    s.add_argument("--workdir", default=None, help="sweep directory: one run per member, "
                                                   "results.jsonl (default: runs/<experiment name>)")
    s.add_argument("--quick", action="store_true", help="the experiment's small grid")
    s.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="members at once, as separate processes (default 1: one after another "
                        "in this process)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of every member (repeatable)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")

    _add_compile_parser(sub)
    _add_compare_parser(sub)
    sub.add_parser("experiments", help="list the experiments that --experiment accepts")
    return p


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="evaluate the latest checkpoint of a workdir (its task's "
                                    "eval loss), or run lm-evaluation-harness tasks (--tasks)")
    e.add_argument("--workdir", default=None)
    e.add_argument("--batches", type=int, default=None, help="number of eval batches (default: the config's)")
    h = e.add_argument_group("lm-evaluation-harness (pip install -e '.[eval]')")
    h.add_argument("--tasks", default=None, metavar="A,B",
                   help="harness task names (hellaswag, lambada_openai, ... or yours in "
                        "--include-path); a workdir's results are appended to its metrics.jsonl")
    h.add_argument("--init-from", default=None, metavar="DIR",
                   help="with --tasks: a Hugging Face save_pretrained directory (or a workdir) "
                        "instead of --workdir")
    h.add_argument("--include-path", default=None, metavar="DIR", help="more task YAMLs")
    h.add_argument("--num-fewshot", type=int, default=None, metavar="K")
    h.add_argument("--limit", type=float, default=None, metavar="N",
                   help="at most N >= 1 documents per task, or a fraction in (0, 1) of them "
                        "(default: every document)")
    h.add_argument("--batch-size", type=int, default=16, metavar="B", help="rows per forward (16)")
    h.add_argument("--dtype", default="float32", metavar="float32|bfloat16",
                   help="parameters and compute (default float32, as lm_eval --model hf; "
                        "bfloat16 halves the memory)")
    h.add_argument("--mesh", default=None, metavar="fsdp=-1|tensor=N|data=N,...",
                   help="device mesh as train --mesh (default: all devices on data, parameters "
                        "replicated); fsdp and tensor shard the parameters")
    h.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                   help="bootstrap resamples for the stderr of perplexities (0: none)")
    h.add_argument("--output", default=None, metavar="OUT.json", help="write the results JSON")


def _add_compile_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile an experiment's step for a TPU slice with the "
                                       "real TPU compiler, on this host; report its memory per "
                                       "device, collectives and estimated step time")
    c.add_argument("--experiment", default=None, help="experiment name in experiments/ or a path")
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--tpu", default=None, metavar="TYPE",
                       help="Cloud TPU type: v2-8, v3-8, v4-8 ... v4-N, v5e-1/4/8/16/... "
                            "(v5litepod-N), v5p-8/..., v6e-1/4/8/...")
    where.add_argument("--topology", default=None, metavar="NAME",
                       help="JAX's topology name instead, e.g. v5e:2x4 or v4:2x2x4")
    c.add_argument("--mesh", default=None, metavar="data=N,fsdp=N,tensor=N",
                   help="device mesh (default: the experiment's)")
    c.add_argument("--what", choices=("train", "eval", "decode"), default="train",
                   help="the train step (default), the eval step, or generate's decode loop")
    c.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                   help="--what decode: tokens generated after each prompt (default 64, or "
                        "half of seq_len / model.max_len when shorter)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable)")
    c.add_argument("--mfu", type=float, default=0.4,
                   help="model FLOPs utilisation the step-time estimate assumes (default 0.4)")
    c.add_argument("--json", action="store_true",
                   help="also print the report as one JSON object, the last line of stdout")


def _add_compare_parser(sub) -> None:
    from .compare_torch import DEFAULT_GRAD_TOLERANCE, DEFAULT_TOLERANCE

    c = sub.add_parser("compare-torch", help="train an experiment here and in PyTorch from the "
                                             "same weights on the same batches; compare the "
                                             "loss curves step by step")
    c.add_argument("--experiment", default=None, help="experiment name in experiments/ or a path")
    c.add_argument("--workdir", default=None, help="where compare.jsonl and compare.png go "
                                                   "(default: runs/compare_torch/<experiment name>)")
    c.add_argument("--steps", type=int, default=30, help="training steps on each side (default 30)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable)")
    c.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face directory or a transformer_jax workdir")
    c.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="largest relative loss difference that passes (default "
                        f"{DEFAULT_TOLERANCE:g}, from the measured drift: docs/compare_torch.md)")
    c.add_argument("--grad-tolerance", type=float, default=DEFAULT_GRAD_TOLERANCE,
                   help="largest relative gradient-norm difference that passes (default "
                        f"{DEFAULT_GRAD_TOLERANCE:g}; it drifts faster than the loss)")
    c.add_argument("--float64-reference", action="store_true",
                   help="also train PyTorch in float64, and report how far each float32 run "
                        "strays from it (the yardstick for their drift)")


def _compare_torch(args) -> int:
    from .compare_torch import compare, describe
    from .train.config import apply_overrides, load_experiment

    cfg = apply_overrides(load_experiment(args.experiment), list(args.overrides))
    if args.init_from is not None:
        cfg = cfg.replace(init_from=args.init_from)
    workdir = args.workdir or os.path.join("runs", "compare_torch", cfg.name)
    summary = compare(cfg, workdir, steps=args.steps, tolerance=args.tolerance,
                      grad_tolerance=args.grad_tolerance, float64_reference=args.float64_reference)
    print(describe(summary))
    print("wrote " + " and ".join(summary["files"]))
    return 0 if summary["within"] else 1


def _train(args) -> int:
    from .train import distributed
    from .train.config import apply_overrides, load_experiment, named_model_fields
    from .train.resume import resume_settings
    from .run import train

    # before anything touches the devices
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    main = distributed.is_main()
    cfg = load_experiment(args.experiment)
    workdir = args.workdir or os.path.join("runs", cfg.name)
    if args.resume or args.resume_from is not None:   # the run's own settings, --set on top
        cfg = resume_settings(cfg, workdir, experiment=args.experiment)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.parallelism is not None:
        overrides.append(f"parallelism={args.parallelism}")
    if args.mesh is not None:
        overrides.append(f"mesh={args.mesh}")
    # an experiment without a start of its own: its model settings are for training from
    # scratch, so that an --init-from start reports only those given here as not applying
    given = named_model_fields(overrides) if cfg.init_from is None else None
    cfg = apply_overrides(cfg, overrides)
    if args.init_from is not None:
        cfg = cfg.replace(init_from=args.init_from)
    if main:
        dataset = cfg.dataset if isinstance(cfg.dataset, str) else f"{len(cfg.dataset)} documents"
        model = (f"{cfg.model}/{cfg.model_preset}" if cfg.init_from is None
                 else f"the model of {cfg.init_from}")
        print(f"training {cfg.name}: {model} on {dataset}, {cfg.steps} steps "
              f"-> {workdir}", flush=True)
    summary = train(cfg, workdir, resume=args.resume, progress=not args.no_progress,
                    resume_from=args.resume_from, given_model=given)
    if summary.get("nothing_to_do"):
        if main:
            print(summary["nothing_to_do"], file=sys.stderr)
        return 0
    if main:
        print(json.dumps(summary, indent=2))
    if summary.get("interrupted"):
        print(f"stopped by {summary['interrupted']} at step {summary['final_step']}; checkpoint saved. "
              f"Continue with: transformer-jax train --workdir {shlex.quote(workdir)} --resume "
              "(it takes the run's settings from its config.json)", file=sys.stderr)
        return 143 if summary["interrupted"] == "SIGTERM" else 130
    return 0


def _eval(args) -> int:
    from .errors import UserError

    if args.tasks is not None:
        return _harness(args)
    if args.workdir is None:
        raise UserError("eval needs --workdir DIR (or --tasks A,B for the lm-evaluation-harness)")
    harness_only = [flag for flag, value in (("--init-from", args.init_from),
                                             ("--include-path", args.include_path),
                                             ("--num-fewshot", args.num_fewshot),
                                             ("--limit", args.limit), ("--output", args.output),
                                             ("--mesh", args.mesh),
                                             ("--dtype", None if args.dtype == "float32"
                                              else args.dtype))
                    if value is not None]
    if harness_only:
        raise UserError(f"{', '.join(harness_only)} go with --tasks (the lm-evaluation-harness)")
    from .workdir import evaluate_workdir

    print(json.dumps(evaluate_workdir(args.workdir, batches=args.batches), indent=2))
    return 0


def _harness(args) -> int:
    from .errors import UserError
    from .train import distributed

    if args.workdir is None and args.init_from is None:
        raise UserError("eval --tasks needs one of --workdir DIR or --init-from DIR")
    if args.workdir is not None and args.init_from is not None:
        raise UserError("eval --tasks got both --workdir and --init-from; give --workdir DIR "
                        "(a run's checkpoint) or --init-from DIR (an HF directory), not both")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks names no task; give e.g. --tasks hellaswag,arc_easy")
    limit = _harness_limit(args.limit)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot}: give K >= 0 examples, or omit it "
                        "for each task's default")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UserError(f"--output {args.output}: its directory does not exist; create it first")
    distributed.initialize(None, None, None)     # a pod or $TRANSFORMER_JAX_COORDINATOR...
    from . import eval_harness, sharding

    import jax

    eval_harness.harness_dtype(args.dtype)        # both refused before any model loads
    sharding.mesh_shape(args.mesh, jax.device_count())

    step = None
    if args.workdir is not None:
        step = eval_harness.checkpoint_step(args.workdir)
        if step is None:
            raise UserError(f"--workdir {args.workdir} holds no checkpoint; for a Hugging Face "
                            "save_pretrained directory use --init-from DIR")
    source = args.workdir or args.init_from
    lm = eval_harness.HarnessLM.from_dir(source, batch_size=args.batch_size, dtype=args.dtype,
                                         mesh=args.mesh)
    results = eval_harness.run_harness(lm, tasks, include_path=args.include_path,
                                       num_fewshot=args.num_fewshot, limit=limit,
                                       bootstrap_iters=args.bootstrap_iters)
    if results is None:       # another process than 0
        return 0
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.workdir is not None:
        setting = eval_harness.harness_setting(tasks, args.num_fewshot, limit, results)
        eval_harness.append_metrics(args.workdir, step,
                                    {"harness": setting, **eval_harness.flat_metrics(results)})
        print(f"appended the harness metrics at step {step} to "
              f"{os.path.join(args.workdir, 'metrics.jsonl')}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.output}")
    return 0


def _harness_limit(limit: float | None) -> int | float | None:
    """``--limit`` as the harness takes it: None (every document), N >= 1 documents (an
    int) or a fraction in (0, 1); anything else is a UserError."""
    from .errors import UserError

    if limit is None or 0 < limit < 1:
        return limit
    if limit >= 1 and float(limit).is_integer():
        return int(limit)
    problem = "would score no document" if limit <= 0 else "is not a whole number of documents"
    raise UserError(f"--limit {limit:g} {problem}; omit --limit to use every document, or "
                    "give N >= 1 documents per task or a fraction in (0, 1)")


def _generate(args) -> int:
    from .workdir import load_run

    _, model, params, task = load_run(args.workdir)
    print(task.generate_text(model, params, args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed,
                             say=lambda message: print(f"warning: {message}", file=sys.stderr,
                                                       flush=True)))
    return 0


def _export(args) -> int:
    from .export import export

    print(json.dumps(export(args.workdir, args.out, fmt=args.format, merge=args.merge), indent=2))
    return 0


def _sweep(args) -> int:
    from .train import distributed
    from .train.config import experiment_path
    from .sweep import SweepInterrupted, run_sweep

    distributed.initialize(None, None, None)
    workdir = args.workdir or os.path.join("runs", experiment_path(args.experiment).stem)
    try:
        out = run_sweep(args.experiment, workdir, quick=args.quick, parallel=args.parallel,
                        overrides=args.overrides, progress=True, bars=not args.no_progress)
    except SweepInterrupted as e:
        print(f"{e}: {_sweep_command(args, workdir)}", file=sys.stderr)
        return 143 if e.signal == "SIGTERM" else 130
    out.pop("rows")
    if isinstance(out["analysis"], dict):   # its numbers; the lists (members, ...) are in its files
        out["analysis"] = {k: v for k, v in out["analysis"].items()
                           if not isinstance(v, (list, dict)) or k.endswith("_ci")}
    print(json.dumps(out, indent=2))
    return 0


def _sweep_command(args, workdir: str) -> str:
    """The ``transformer-jax sweep`` command that continues this one: every flag it had."""
    words = ["transformer-jax", "sweep", "--experiment", args.experiment, "--workdir", workdir]
    words += ["--quick"] if args.quick else []
    words += ["--parallel", str(args.parallel)] if args.parallel != 1 else []
    for item in args.overrides:
        words += ["--set", item]
    words += ["--no-progress"] if args.no_progress else []
    return shlex.join(words)


def _compile(args) -> int:
    from .aot import compile_experiment
    from .tpu import TpuSlice
    from .train.config import apply_overrides, load_experiment

    tpu = TpuSlice.parse(args.tpu) if args.tpu else TpuSlice.from_topology(args.topology)
    cfg = apply_overrides(load_experiment(args.experiment), list(args.overrides))
    from .errors import UserError
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu {args.mfu} must be in (0, 1]")
    if args.decode_tokens is not None and args.what != "decode":
        raise UserError(f"--decode-tokens applies to --what decode, not --what {args.what}; "
                        "drop it or add --what decode")
    report = compile_experiment(cfg, tpu, mesh=args.mesh, what=args.what, mfu=args.mfu,
                                decode_tokens=args.decode_tokens)
    print(report.describe(), flush=True)
    if args.json:
        print(json.dumps(report.to_dict()))
    if not report.fits:
        print("error: " + report.not_fit_message(), file=sys.stderr)
        return 2
    return 0


def _experiments(args) -> int:
    from .train.config import available_experiments, experiment_dirs

    names = available_experiments()
    print("\n".join(names) if names else
          f"no experiments found in {', '.join(str(d) for d in experiment_dirs())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from .host_memory import tune_malloc_if_cpu
    tune_malloc_if_cpu()   # before JAX starts its threads; TRANSFORMER_JAX_TUNE_MALLOC=0 turns it off
    from . import storage
    from .errors import UserError
    from .train.loop import NonFiniteLossError
    from .train.checkpoint import CheckpointWriteError

    handlers = {"train": _train, "eval": _eval, "generate": _generate, "export": _export,
                "sweep": _sweep, "compile": _compile, "compare-torch": _compare_torch,
                "experiments": _experiments}
    _quiet_background_errors()
    try:
        return handlers[args.command](args)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)   # one line
        if isinstance(e, CheckpointWriteError):
            _silence_stderr_from_now_on()
        return 2
    except OSError as e:
        if e.errno not in storage.WRITE_ERRNOS:
            raise
        print(f"error: cannot write {e.filename or 'a file'} ({e.strerror}); free space or fix "
              "the permissions (or choose another --workdir); the last checkpoint is intact, "
              "continue with --resume", file=sys.stderr)
        return 2


_CLOSED = "Event loop is closed"


def _silence_stderr_from_now_on() -> None:
    """After a failed checkpoint write has been reported: the writer threads it abandoned
    fail once more as the interpreter shuts down (tracebacks of callbacks into a closed
    event loop, printed from C++); they say nothing new, so they go to /dev/null."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _quiet_background_errors() -> None:
    """A failed checkpoint write or read is reported once, as an ``error:`` or ``warning:``
    line: orbax's own ERROR logs of it (with tracebacks) and those of its abandoned writer
    coroutines at exit are not shown; the exception that reaches the CLI says it all.
    Orbax's warnings, and everything else, still show."""
    from .train.orbax_logs import hide_orbax_errors

    hide_orbax_errors()
    default_unraisable, default_except = sys.unraisablehook, sys.excepthook

    def unraisable(record):   # a failed write's coroutines, and its callbacks into the
        closed = isinstance(record.exc_value, RuntimeError) and str(record.exc_value) == _CLOSED
        if not (closed or "coroutine" in repr(record.object)):   # closed event loop
            default_unraisable(record)

    def excepthook(kind, value, tb):   # the same, where they reach sys.excepthook
        if not (kind is RuntimeError and str(value) == _CLOSED):
            default_except(kind, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook


if __name__ == "__main__":
    sys.exit(main())
