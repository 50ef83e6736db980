"""Sweeps: a grid of ordinary training runs, one results table, and an analysis across them.

  transformer-jax sweep --experiment NAME --workdir DIR [--quick] [--parallel N] [--set k=v ...]

An experiment file becomes a sweep by defining its grid, as a list or a function of ``quick``::

    SWEEP = [["model.d_model=64"], ["model.d_model=128"]]
    def get_sweep(quick: bool) -> list: ...

Each entry is one member: a list of ``key=value`` overrides (what ``--set`` takes), a dict
of them, or ``{"name": ..., "set": [...] or {...}, **meta}``, whose other keys (e.g.
``"group"``) are copied into the member's row. The overrides apply on top of the file's
``get_config()``, and the sweep's own ``--set`` on top of them (every member takes it). An optional
``analyze(workdir, rows, quick) -> dict`` runs once every member has finished.

What a sweep writes:

  DIR/<member>/      an ordinary run (checkpoints, metrics.jsonl, config.json; see
                     train/loop.py) and its ``result.json`` once it has finished
  DIR/results.jsonl  one row per finished member, in grid order: its overrides, parameter
                     counts (total, non-embedding), tokens seen, training FLOPs, final and
                     best eval loss, and every eval as ``curve``
  DIR/sweep.json     the grid, and the wall time of each member

Rows hold no timings, so an interrupted sweep, started again, writes the same
``results.jsonl`` as an uninterrupted one: finished members are skipped, and the member
that was running resumes from its last checkpoint with exactly the losses it would have
had (train/loop.py). SIGTERM or SIGINT stop the sweep (the running member saves a
checkpoint first); the same command continues it.

Members run one after another in this process (the default: it keeps the devices, e.g. a
TPU's cores, and imports JAX once), or ``parallel`` at a time as ``transformer-jax train``
processes (logs in ``DIR/<member>/train.log``). On a machine with several GPUs each
process gets one (``CUDA_VISIBLE_DEVICES``); on a CPU they share the cores; a TPU host
cannot be shared, so there members run one after another.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import storage
from .errors import UserError
from .train.config import ExperimentConfig, apply_overrides, experiment_call, experiment_module


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a sweep: its directory name, its overrides, and extra row fields."""
    name: str
    overrides: tuple[str, ...]
    meta: dict = dataclasses.field(default_factory=dict)


class SweepInterrupted(Exception):
    """A signal stopped the sweep; the running member saved a checkpoint."""

    def __init__(self, signum: int, done: int, total: int):
        self.signal = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal} with {done}/{total} members done; run the "
                         "same command again to continue")


# ----------------------------------------------------------------------------- the grid

def _as_strings(overrides, where: str) -> tuple[str, ...]:
    if isinstance(overrides, dict):
        return tuple(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items())
    if isinstance(overrides, (list, tuple)) and all(isinstance(o, str) and "=" in o for o in overrides):
        return tuple(overrides)
    raise UserError(f"{where}: overrides must be a list of 'key=value' strings or a dict, got "
                    f"{overrides!r}")


def _default_name(overrides: tuple[str, ...]) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}-{v.strip(chr(39) + chr(34))}" for k, _, v in (o.partition("=") for o in overrides)]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts) or "base").strip("-")[:100]


def members_of(module, quick: bool) -> list[Member]:
    """The members an experiment module's ``SWEEP`` or ``get_sweep(quick)`` defines."""
    where = getattr(module, "__file__", "the experiment")
    if hasattr(module, "get_sweep"):
        entries = experiment_call(module, "get_sweep", quick)
    elif hasattr(module, "SWEEP"):
        entries = module.SWEEP
    else:
        raise UserError(f"{where} defines no grid: add SWEEP = [...] or get_sweep(quick) -> list "
                        "(each entry a list of 'key=value' overrides); `transformer-jax train` "
                        "runs a single experiment")
    if not isinstance(entries, (list, tuple)) or not entries:
        raise UserError(f"{where}: the grid must be a non-empty list of members, got {entries!r}")
    members = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and "set" in entry:
            meta = {k: v for k, v in entry.items() if k not in ("name", "set")}
            overrides = _as_strings(entry["set"], f"{where}: member {i}")
            name = entry.get("name") or _default_name(overrides)
        else:
            meta, overrides = {}, _as_strings(entry, f"{where}: member {i}")
            name = _default_name(overrides)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise UserError(f"{where}: member name {name!r} is not a directory name (letters, "
                            "digits, '.', '_', '-')")
        members.append(Member(name, overrides, meta))
    seen = [m.name for m in members]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise UserError(f"{where}: members {twice} appear twice in the grid; give each a "
                        "distinct 'name' (or distinct overrides)")
    return members


def member_config(base: ExperimentConfig, common: list[str], member: Member) -> ExperimentConfig:
    """The member's config: the experiment's, the member's overrides, then the sweep's
    ``--set`` (which every member takes, over its own)."""
    return apply_overrides(base, [*member.overrides, *common])


# ----------------------------------------------------------------------------- rows

def member_row(member: Member, cfg: ExperimentConfig, workdir: Path) -> dict[str, Any]:
    """The results row of a finished member, from its workdir (config.json, metrics.jsonl).
    FLOPs are the task's ``flops_per_step`` (GPT: 6 N + 12 L D T per token) x steps."""
    from .workdir import run_costs
    from .train.monitor import read_metrics

    costs = run_costs(workdir)
    per_step_tokens, per_step_flops = costs["tokens_per_step"], costs["flops_per_step"]
    curve = [{"step": r["step"], "tokens": r["step"] * per_step_tokens,
              "flops": r["step"] * per_step_flops, "eval_loss": r["eval_loss"]}
             for r in read_metrics(workdir) if "eval_loss" in r]
    if not curve or curve[-1]["step"] != cfg.steps:
        raise UserError(f"member {member.name}: {workdir}/metrics.jsonl has no eval at the last "
                        f"step {cfg.steps}; run it again (delete {workdir}) or check its train.log")
    best = min(curve, key=lambda p: p["eval_loss"])
    return {"member": member.name, **member.meta, "overrides": list(member.overrides),
            "params": costs["params"], "non_embedding_params": costs["non_embedding_params"],
            "steps": cfg.steps, "tokens": cfg.steps * per_step_tokens,
            "flops": cfg.steps * per_step_flops, "flops_per_token": per_step_flops / per_step_tokens,
            "train_tokens": cfg.task_options.get("train_tokens"),
            "final_eval_loss": curve[-1]["eval_loss"], "best_eval_loss": best["eval_loss"],
            "best_step": best["step"], "curve": curve}


def read_results(workdir: str | Path) -> list[dict]:
    """The rows of ``DIR/results.jsonl`` (empty if there is none yet)."""
    path = storage.path(workdir) / "results.jsonl"
    return [json.loads(line) for line in storage.read_text(path).splitlines()] if storage.exists(path) else []


# ----------------------------------------------------------------------------- running

def _has_checkpoint(workdir: Path) -> bool:
    directory = workdir / "checkpoints"
    return storage.is_dir(directory) and any(p.name.isdigit() for p in directory.iterdir())


def _run_here(cfg: ExperimentConfig, workdir: Path, progress: bool) -> None:
    from .run import train

    summary = train(cfg, workdir, resume=_has_checkpoint(workdir), progress=progress)
    if summary.get("interrupted"):
        raise KeyboardInterrupt(summary["interrupted"])


def _gpu_count() -> int:
    """GPUs this machine has (``nvidia-smi -L``), without starting JAX in this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None or shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _spawn(experiment: Path, common: list[str], member: Member, workdir: Path, slot: int,
           gpus: int) -> tuple[subprocess.Popen, Path]:
    """The member's ``transformer-jax train`` process, and the local file its output goes
    to (``DIR/<member>/train.log``; for a bucket, a temporary file :func:`_keep_log` copies)."""
    cmd = [sys.executable, "-m", "transformer_jax.cli", "train", "--experiment", str(experiment),
           "--workdir", str(workdir), "--no-progress"]
    for item in (*member.overrides, *common):   # as member_config: --set last
        cmd += ["--set", item]
    if _has_checkpoint(workdir):
        cmd.append("--resume")
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
    storage.makedirs(workdir)
    if storage.is_remote(workdir):   # a process writes a local file; copied when it ends
        fd, name = tempfile.mkstemp(prefix=f"{member.name}.", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    else:
        log_path = Path(workdir) / "train.log"
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log_path


def _keep_log(log_path: Path, workdir: Path) -> None:
    """A bucket member's log, from its local temporary file to ``DIR/<member>/train.log``."""
    if storage.is_remote(workdir):
        storage.append_text(workdir / "train.log", log_path.read_text(errors="replace"))
        log_path.unlink()


class _Sweep:
    """The state of one ``run_sweep`` call: the grid, the finished rows, timings, progress."""

    def __init__(self, name, experiment, workdir, members, configs, common, on_member, progress,
                 bars):
        self.name, self.experiment, self.workdir = name, experiment, workdir
        self.members, self.configs, self.common = members, configs, common
        self.on_member, self.progress, self.bars = on_member, progress, bars
        self.rows: dict[str, dict] = {}
        self.seconds: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.signum: int | None = None
        self.children: list[subprocess.Popen] = []   # parallel mode: the running members
        self._load()

    def _load(self) -> None:
        """Rows of members finished by an earlier start; refuses a changed grid."""
        self.timings = {}
        if storage.exists(self.workdir / "sweep.json"):
            saved = json.loads(storage.read_text(self.workdir / "sweep.json"))
            self.timings = saved.get("seconds", {})
        for m in self.members:
            path = self.workdir / m.name / "result.json"
            if not storage.exists(path):
                continue
            row = json.loads(storage.read_text(path))
            if row["overrides"] != list(m.overrides):
                raise UserError(f"{path.parent} was run with overrides {row['overrides']}, but the "
                                f"grid now gives {list(m.overrides)}; use another --workdir, or "
                                "delete that member's directory to run it again")
            self._check_settings(m, path.parent)
            self.rows[m.name] = row

    def _check_settings(self, member: Member, workdir: Path) -> None:
        """A finished member was trained with the config the sweep now gives it: not another
        ``--set``, nor an experiment file changed since."""
        saved = json.loads(storage.read_text(workdir / "config.json"))["experiment"]
        now = json.loads(json.dumps(self.configs[member.name].to_dict()))
        changed = sorted(k for k in set(saved) | set(now)   # logging changes no result
                         if k != "log" and saved.get(k) != now.get(k))
        if changed:
            diff = "; ".join(f"{k}: {saved.get(k)!r} then, {now.get(k)!r} now" for k in changed[:4])
            raise UserError(f"{workdir} was trained with other settings than the sweep gives it "
                            f"now ({diff}); start again with the same experiment and --set, use "
                            "another --workdir, or delete that member's directory to run it again")

    def finish(self, member: Member, seconds: float) -> None:
        """Records a member that has trained to its last step: row, results, progress line."""
        row = member_row(member, self.configs[member.name], self.workdir / member.name)
        storage.write_text(self.workdir / member.name / "result.json", json.dumps(row, indent=1) + "\n")
        self.rows[member.name] = row
        self.seconds[member.name] = seconds
        self.timings[member.name] = round(seconds, 2)
        self.write()
        if self.progress:
            print(self.progress_line(member, row, seconds), flush=True)
        if self.on_member is not None:
            self.on_member(member.name, self.results())

    def results(self) -> list[dict]:
        return [self.rows[m.name] for m in self.members if m.name in self.rows]

    def write(self) -> None:
        storage.write_text(self.workdir / "results.jsonl",
                           "".join(json.dumps(r) + "\n" for r in self.results()))
        storage.write_text(self.workdir / "sweep.json", json.dumps(
            {"experiment": str(self.experiment), "common": self.common,
             "members": [{"name": m.name, "overrides": list(m.overrides), **m.meta}
                         for m in self.members],
             "seconds": self.timings}, indent=1) + "\n")

    def progress_line(self, member: Member, row: dict, seconds: float) -> str:
        done = len(self.rows)
        eta = self.eta()
        return (f"sweep {self.name}: {done}/{len(self.members)} members done ({member.name}: eval loss "
                f"{row['final_eval_loss']:.3f} in {_clock(seconds)}); elapsed "
                f"{_clock(time.perf_counter() - self.t0)}"
                + ("" if eta is None else f", ETA {_clock(eta)}"))

    def eta(self) -> float | None:
        """Seconds left: each member costs a fixed part (the quickest member so far) plus a
        part proportional to its planned FLOPs, the rate fitted to the members finished in
        this call."""
        left = [m for m in self.members if m.name not in self.rows]
        if not left or not self.seconds:
            return 0.0 if not left else None
        base = min(self.seconds.values())
        work = sum(_planned_flops(self.configs[n]) for n in self.seconds)
        busy = sum(self.seconds.values()) - base * len(self.seconds)
        per_flop = busy / work if work > 0 else 0.0
        return sum(base + per_flop * _planned_flops(self.configs[m.name]) for m in left)


def _planned_flops(cfg: ExperimentConfig) -> float:
    """A member's training FLOPs as far as they are known before it runs (its vocabulary
    comes from its task): 6 N per token, N its non-embedding parameters."""
    from .models import FAMILIES

    try:
        n = FAMILIES[cfg.model][0].preset(cfg.model_preset, **cfg.model_overrides).num_params(
            non_embedding=True)
    except Exception:   # noqa: BLE001 - an estimate only; the run reports any real mistake
        return 0.0
    return 6.0 * n * cfg.steps * cfg.batch_size * cfg.seq_len


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


# ----------------------------------------------------------------------------- the sweep

def _sequential(sweep: _Sweep, todo: list[Member]) -> None:
    for member in todo:
        t = time.perf_counter()
        _run_here(sweep.configs[member.name], sweep.workdir / member.name, sweep.bars)
        sweep.finish(member, time.perf_counter() - t)


def _prepare_data(configs: list[ExperimentConfig]) -> None:
    """Prepares the named text datasets the members read (``python_stdlib`` is built, a TFDS
    dataset downloaded), once, before processes that would each prepare it at the same time."""
    from .data import open_source

    seen = set()
    for cfg in configs:
        if cfg.task not in ("lm", "mlm") or not isinstance(cfg.dataset, str):
            continue
        for split in ("train", cfg.eval_split):
            if (cfg.dataset, split, cfg.data_dir) not in seen:
                seen.add((cfg.dataset, split, cfg.data_dir))
                open_source(cfg.dataset, split, data_dir=cfg.data_dir)


def _parallel(sweep: _Sweep, todo: list[Member], parallel: int) -> None:
    """``parallel`` ``transformer-jax train`` processes at a time, in grid order; a signal
    is passed on to them (each saves a checkpoint), and a failed member stops the sweep
    once the others have finished."""
    _prepare_data([sweep.configs[m.name] for m in todo])
    gpus = _gpu_count()
    queue, running, failed = list(todo), {}, []
    try:
        while queue or running:
            while queue and len(running) < parallel and not failed and sweep.signum is None:
                member = queue.pop(0)
                slot = min(set(range(parallel)) - {s for _, s, *_ in running.values()})
                proc, log = _spawn(sweep.experiment, sweep.common, member,
                                   sweep.workdir / member.name, slot, gpus)
                running[member.name] = (proc, slot, time.perf_counter(), log)
                sweep.children = [p for p, *_ in running.values()]
            time.sleep(0.2)
            for name, (proc, _, t, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                sweep.children = [p for p, *_ in running.values()]
                _keep_log(log, sweep.workdir / name)
                member = next(m for m in sweep.members if m.name == name)
                if proc.returncode == 0:
                    sweep.finish(member, time.perf_counter() - t)
                elif sweep.signum is None and proc.returncode in (130, 143):   # signalled alone
                    sweep.signum = signal.SIGINT if proc.returncode == 130 else signal.SIGTERM
                elif sweep.signum is None:
                    failed.append((name, proc.returncode))
            if sweep.signum is not None and not running:
                raise KeyboardInterrupt
    finally:
        for proc, *_ in running.values():   # an exception here: stop them cleanly
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, (proc, _, _, log) in running.items():
            proc.wait()
            _keep_log(log, sweep.workdir / name)
    if failed:
        name, code = failed[0]
        raise UserError(f"member {name} failed (exit status {code}); see "
                        f"{sweep.workdir / name / 'train.log'}; the sweep continues from there "
                        "when started again")


@contextlib.contextmanager
def _signals(sweep: _Sweep, parallel: int):
    """SIGTERM/SIGINT: in parallel mode, recorded (the children get it too: passed on);
    in this process, outside a member's training steps (which handle it themselves),
    they stop the sweep at once: files are written atomically, so nothing is half done."""
    def handler(signum, frame):
        sweep.signum = signum
        if parallel == 1:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        for proc in sweep.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_sweep(experiment: str, workdir: str | Path, *, quick: bool = False, parallel: int = 1,
              overrides: list[str] | tuple[str, ...] = (), progress: bool = True,
              bars: bool | None = None, on_member: Callable[[str, list[dict]], None] | None = None,
              analyze: bool = True, only: list[str] | tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run (or continue) an experiment's grid in ``workdir``; see the module docstring.

    ``progress``: the sweep's lines (its start, and "N/M members done" with the ETA after
    each member); ``bars``: each member's training progress bar (default: ``progress``).
    ``on_member(name, rows)`` is called after each member with the rows so far (a notebook
    draws from them); ``only``: run just these members of the grid (by name). Returns ``{"workdir", "members", "rows", "analysis", "seconds"}``;
    raises :class:`SweepInterrupted` when a signal stopped it.
    """
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise UserError(f"--parallel {parallel!r} must be an int >= 1 (processes at once)")
    module = experiment_module(experiment)
    base = experiment_call(module, "get_config")
    if not isinstance(base, ExperimentConfig):
        raise UserError(f"{module.__file__}: get_config() must return an ExperimentConfig, got "
                        f"{type(base).__name__}")
    members = members_of(module, quick)
    if only is not None:
        unknown = sorted(set(only) - {m.name for m in members})
        if unknown:
            raise UserError(f"only={unknown} names no member of the grid; its members: "
                            f"{[m.name for m in members]}")
        members = [m for m in members if m.name in set(only)]
    configs = {m.name: member_config(base, list(overrides), m) for m in members}   # all checked first
    workdir = storage.path(workdir)
    storage.check_workdir(workdir)
    storage.makedirs(workdir)
    sweep = _Sweep(base.name, Path(module.__file__), workdir, members, configs, list(overrides),
                   on_member, progress, progress if bars is None else bars)
    todo = [m for m in members if m.name not in sweep.rows]
    if progress:
        print(f"sweep {base.name}: {len(members)} members, {len(members) - len(todo)} done before "
              f"-> {workdir}", flush=True)
    sweep.write()
    with _signals(sweep, parallel):
        try:
            (_sequential(sweep, todo) if parallel == 1 else _parallel(sweep, todo, parallel))
        except KeyboardInterrupt as e:   # from a signal here, or from a member's training loop
            named = e.args[0] if e.args and e.args[0] in signal.Signals.__members__ else "SIGINT"
            signum = sweep.signum or signal.Signals[named]
            raise SweepInterrupted(signum, len(sweep.rows), len(members)) from None
    rows = sweep.results()
    result = None
    if analyze and hasattr(module, "analyze"):
        result = module.analyze(workdir, rows, quick)
    return {"workdir": str(workdir), "members": len(rows), "rows": rows, "analysis": result,
            "seconds": time.perf_counter() - sweep.t0}
