"""Fine-tuning the default GPT four ways on stdlib code it never trained on: full, LoRA,
QLoRA (NF4) and prefix tuning.

Commands::

    python experiments/finetune_stdlib.py           # pretrain (or reuse) + all four runs
    python experiments/finetune_stdlib.py --quick   # short runs (a smoke test of the pipeline)
    python experiments/finetune_stdlib.py --packing # prompt/completion examples: padded rows
                                                    # vs packed (docs/finetuning.md has the table)
    # one run, LoRA (this file's get_config()), from a finished stdlib_gpt run:
    transformer-jax train --experiment finetune_stdlib --init-from runs/stdlib_gpt \\
        --workdir runs/finetune_stdlib/lora

Base model: ``experiments/stdlib_gpt.py`` (byte-level GPT, 4 layers, width 128, 0.8M
parameters), reused from ``runs/stdlib_gpt`` when that holds a finished run (a checkpoint
at its last step) and trained there first otherwise (600 steps, ~3.5 min here).

Data: the held-out slice is the 14 modules of the ``validation`` split of ``python_stdlib``
(``stdlib_corpus.VALIDATION_FILES``: argparse, csv, statistics, urllib/parse, ...), which
the pretraining run only evaluated on and never trained on. Each module is cut at a line
boundary: its first 80% of lines is the fine-tuning data (``dataset``: a list of 14
in-memory documents, ~360 KB), its last 20% the test text (~90 KB) that no run trains on.
The ``eval`` rows a run writes itself (``metrics.jsonl``) score the in-memory dataset, i.e.
the fine-tuning text; the table's "test" losses are computed here on the test text, for
the pretrained model ("before") and for each fine-tuned one ("after").

Runs (each an ordinary ``train()`` run with ``init_from`` = the pretrained workdir, in
``runs/finetune_stdlib/<method>``, replaced when this script runs again): 200 steps of
32 x 128 bytes (~2.3 epochs of the slice), warmup 20 + cosine; AdamW as pretraining:

* ``full``: every parameter, peak lr 5e-4;
* ``lora``: rank 8, alpha 16 on ``attn/(query|value)`` (16,384 parameters), peak lr 1e-2;
* ``lora_bf16``: the same, computing in bf16 (``model.dtype``; the adapters and the base
  stay fp32 and are cast in each matmul);
* ``qlora``: the same in bf16 over a base stored as NF4 (``lora.quantize="nf4"``): the
  QLoRA recipe, compared with ``lora_bf16``;
* ``prefix``: 16 learned key/value prefixes per layer (``model.prefix_tokens``), lr 1e-2.

Output: ``runs/finetune_stdlib/results.{md,json}`` (``--quick``: ``runs/finetune_stdlib_quick/``):
method, trainable parameters, optimizer-state bytes (``nbytes`` of ``state.opt_state``), the
median step time after compilation (from the runs' logged tokens/s), the test loss before
and after, and the loss on the fine-tuning text after.

Runtime here (2 CPU cores, AMD EPYC, shared: load average 5-9 during the run): 8.9 min for
full, lora, qlora (then in fp32) and prefix with ``runs/stdlib_gpt`` reused (+3.5 min to
pretrain it on an idle machine); ``lora_bf16`` and ``qlora`` (bf16) took 84 s and 139 s in a
second invocation (``--methods lora_bf16,qlora``); ``--quick`` (20 steps a method) about 3
min. Results (2026-12-02, nats/byte; test text before: 1.718, fine-tuning text before:
1.518)::

  method     trainable  optimizer bytes  step ms  test after  fine-tuning text after
  full         859,264        6,874,120      679       1.585                   1.239
  lora          16,384          131,080      308       1.677                   1.411
  lora_bf16     16,384          131,080      249       1.677                   1.411
  qlora         16,384          131,080      646       1.679                   1.413
  prefix        16,384          131,080      411       2.150                   2.024

Full fine-tuning fits the slice best and also overfits it most (1.239 on the text it
trained on, 1.585 on the test text); LoRA gets a third of the test gain with 1.9% of the
parameters and of the optimizer state; bf16 compute changes none of the three decimals.
QLoRA ends 0.002 nats above bf16 LoRA with the frozen base stored in 0.73 MB instead of
3.4 MB (NF4 kernels; embeddings, norms and biases stay fp32); on the CPU its step is the
slowest of the adapter runs (the NF4 kernels are dequantized in every step, forward and
backward). The step times move with the machine's load: the full run's came while it was
busiest; full and lora run again alone (load 3-6) took 466 and 382 ms a step, with the
same losses (the runs are deterministic). The adapter runs skip the weight gradients but
keep the whole forward and backward pass through the activations.
Prefix tuning gets worse, not better: its prefixes start as N(0, 1) keys and values (PEFT's
default) and its tokens are numbered from position 16, so the pretrained model starts at
2.64 on the test text and 200 steps do not recover it (positions 128-143, which pretraining
at context 128 never trained, are used by the last 16 tokens of each window).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformer_jax.train.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[1]
PRETRAINED = "runs/stdlib_gpt"
HELD_OUT = 0.2              # the last 20% of each module's lines: the test text
METHODS = ("full", "lora", "lora_bf16", "qlora", "prefix")
LORA = {"rank": 8, "alpha": 16, "targets": "attn/(query|value)"}


def slices(data_dir: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """``(paths, fine-tuning docs, test docs)`` of the validation modules, sorted by path:
    each module's first 80% of lines and its last 20%."""
    from transformer_jax.data import open_source

    source, _ = open_source("python_stdlib", "validation", data_dir=data_dir)
    modules = []
    for i in range(len(source)):
        example = source[i]
        text, path = example["text"], example["path"]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        path = path.decode("utf-8") if isinstance(path, bytes) else str(path)
        modules.append((path, text))
    modules.sort()
    paths, train_docs, test_docs = [], [], []
    for path, text in modules:
        lines = text.splitlines(keepends=True)
        cut = round(len(lines) * (1 - HELD_OUT))
        paths.append(path)
        train_docs.append("".join(lines[:cut]))
        test_docs.append("".join(lines[cut:]))
    return paths, train_docs, test_docs


def method_config(method: str, *, steps: int = 200, init_from: str | None = PRETRAINED,
                  docs: list[str] | None = None) -> ExperimentConfig:
    """The fine-tuning config of one method (``docs``: the fine-tuning documents)."""
    if docs is None:
        docs = slices()[1]
    model = {"dropout_rate": 0.0, "attention_dropout_rate": 0.0}
    lr = {"full": 5e-4, "lora": 1e-2, "lora_bf16": 1e-2, "qlora": 1e-2, "prefix": 1e-2}[method]
    if method in ("lora", "lora_bf16", "qlora"):
        model["lora"] = dict(LORA, **({"quantize": "nf4"} if method == "qlora" else {}))
    if method in ("lora_bf16", "qlora"):       # QLoRA computes in bf16, as in the paper
        model["dtype"] = "bfloat16"
    elif method == "prefix":
        model["prefix_tokens"] = 16
    return ExperimentConfig(
        name=f"finetune_stdlib_{method}", init_from=init_from, dataset=list(docs),
        model_overrides=model, steps=steps, learning_rate=lr,
        warmup_steps=max(1, steps // 10), log_every=10 if steps >= 50 else 5,
        eval_every=steps, eval_batches=16, save_every=steps, keep=1,
        sample_prompt="def ", sample_tokens=96)


def get_config() -> ExperimentConfig:
    """LoRA fine-tuning of ``runs/stdlib_gpt`` (``--init-from`` names another start)."""
    return method_config("lora")


# ----------------------------------------------------------------------------- packing

def line_examples(docs: list[str], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Prompt/completion examples of the docs: each non-blank line (the prompt) and the
    line after it (the completion), in bytes, when the pair and its eos fit ``seq_len + 1``."""
    from transformer_jax.data import ByteTokenizer

    tok, out = ByteTokenizer(), []
    for doc in docs:
        lines = doc.splitlines(keepends=True)
        for a, b in zip(lines, lines[1:]):
            if a.strip() and b.strip():
                prompt, completion = list(tok.encode(a)), list(tok.encode(b))
                if len(prompt) + len(completion) <= seq_len:
                    out.append((prompt, completion))
    return out


def packing_comparison(train_docs, test_docs, *, epochs: dict[str, int] | None = None,
                       batch: int = 16, seq_len: int = 128, lr: float = 3e-3,
                       seed: int = 0) -> dict:
    """Supervised fine-tuning on next-line examples (loss on the completion only) of a fresh
    byte-level GPT (2 layers, width 64), one example per padded row ("padded") vs examples
    packed into rows ("packed": ``data.packing.pack_examples``, segment ids and positions
    per example), ``epochs[name]`` passes over the same examples (default 2 each); the
    held-out loss (after every epoch) is per completion byte of the test text's examples,
    each in its own row."""
    import jax
    import numpy as np
    import optax

    from transformer_jax.data import ByteTokenizer
    from transformer_jax.data.packing import pack_examples
    from transformer_jax.losses import lm_loss, mean_loss
    from transformer_jax.models.gpt import GPT, GPTConfig, init_params

    eos = ByteTokenizer().eos_id
    train, test = line_examples(train_docs, seq_len), line_examples(test_docs, seq_len)
    held_out = pack_examples(test, seq_len, eos_id=eos, pack=False)
    held_out.pop("segment_ids"), held_out.pop("positions")
    model = GPT(GPTConfig.preset("tiny", vocab_size=ByteTokenizer().vocab_size, max_len=seq_len,
                                 dropout_rate=0.0, attention_dropout_rate=0.0))

    def loss_fn(params, b):
        total, sums = lm_loss(model.apply, params, b, None, True, 0.0)
        return mean_loss(total, sums["weight"])

    @jax.jit
    def eval_sums(params, b):
        total, sums = lm_loss(model.apply, params, b, None, True, 0.0)
        return total, sums["weight"]

    def held_out_loss(params) -> float:
        sums = [eval_sums(params, {k: v[i:i + 256] for k, v in held_out.items()})
                for i in range(0, len(held_out["inputs"]), 256)]
        return float(sum(s[0] for s in sums) / sum(s[1] for s in sums))

    epochs = epochs or {"padded": 2, "packed": 2}
    results = {}
    for name, pack in (("padded", False), ("packed", True)):
        if name not in epochs:
            continue
        rows = pack_examples(train, seq_len, eos_id=eos, pack=pack)
        if not pack:
            rows.pop("segment_ids"), rows.pop("positions")
        n = len(rows["inputs"]) // batch
        steps = epochs[name] * n
        opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps))
        params = init_params(model, jax.random.PRNGKey(seed))
        state = opt.init(params)

        @jax.jit
        def step(params, state, b):
            loss, grads = jax.value_and_grad(loss_fn)(params, b)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        t0, per_epoch = time.perf_counter(), []
        for epoch in range(epochs[name]):
            order = np.random.default_rng(seed + epoch).permutation(len(rows["inputs"]))
            for i in range(n):
                idx = order[i * batch:(i + 1) * batch]
                params, state, loss = step(params, state, {k: v[idx] for k, v in rows.items()})
            per_epoch.append({"steps": (epoch + 1) * n, "held_out_loss": held_out_loss(params)})
        seconds = time.perf_counter() - t0
        results[name] = {
            "rows": len(rows["inputs"]), "epochs": epochs[name], "steps": steps,
            "tokens": steps * batch * seq_len,
            "completion_tokens_per_epoch": int(rows["weights"].sum()), "seconds": seconds,
            "held_out_loss": per_epoch[-1]["held_out_loss"], "per_epoch": per_epoch}
        print(f"   {name}: {results[name]}", flush=True)
    return {"examples": len(train), "test_examples": len(test), "batch": batch, "seq_len": seq_len, "lr": lr, **results}


# ----------------------------------------------------------------------------- the runs

def finished(workdir: str | Path) -> bool:
    """Whether ``workdir`` holds a run whose latest checkpoint is its last step."""
    workdir = Path(workdir)
    try:
        config = json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    from transformer_jax.train.checkpoint import CheckpointManager

    if not (workdir / "checkpoints").is_dir():
        return False
    manager = CheckpointManager(workdir / "checkpoints", read_only=True)
    try:
        latest = manager.latest_step()
    finally:
        manager.close()
    return latest is not None and latest >= config["experiment"]["steps"]


def pretrain(workdir: Path, steps: int | None) -> dict:
    """``stdlib_gpt`` into ``workdir`` unless it is finished there already."""
    from transformer_jax.run import train

    if finished(workdir):
        print(f"pretrained model: reusing the finished run in {workdir}", flush=True)
        return {"reused": True}
    if workdir.exists():
        raise SystemExit(f"{workdir} holds an unfinished run; finish it (transformer-jax train "
                         f"--workdir {workdir} --resume) or remove it")
    cfg = ExperimentConfig()
    if steps is not None:
        cfg = cfg.replace(steps=steps, warmup_steps=min(cfg.warmup_steps, steps // 4),
                          eval_every=steps, save_every=steps)
    print(f"pretraining stdlib_gpt ({cfg.steps} steps) into {workdir}", flush=True)
    t0 = time.perf_counter()
    summary = train(cfg, workdir, progress=False)
    return {"reused": False, "steps": cfg.steps, "seconds": time.perf_counter() - t0,
            "eval_loss": summary.get("eval_loss")}


def text_loss(workdir: str | Path, docs: list[str], batches: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) of a workdir's latest checkpoint on ``docs``
    (packed into 128-byte windows, the first ``batches`` batches of 32)."""
    from transformer_jax.models import model_from_config
    from transformer_jax.tasks import make_task
    from transformer_jax.train.checkpoint import load_params
    from transformer_jax.train.loop import evaluate

    run_config, params = load_params(workdir)
    _, model = model_from_config(run_config["family"], run_config["model"])
    cfg = ExperimentConfig.from_dict(run_config["experiment"]).replace(
        dataset=list(docs), eval_batches=batches, init_from=None)
    with tempfile.TemporaryDirectory(prefix="finetune_eval_") as scratch:
        task = make_task(cfg, scratch, spec=run_config["task_spec"])
        return evaluate(params, model.apply, task)["eval_loss"]


def state_sizes(cfg: ExperimentConfig) -> dict:
    """Trainable parameters and optimizer-state bytes of the run ``cfg`` starts (``setup``
    in a scratch directory; nothing is trained)."""
    import jax
    import numpy as np

    from transformer_jax.run import setup

    with tempfile.TemporaryDirectory(prefix="finetune_setup_") as scratch:
        run = setup(cfg, Path(scratch) / "run", progress=False)
        try:
            state = run.state
            leaves = jax.tree_util.tree_leaves
            return {"trainable_params": int(sum(np.size(x) for x in leaves(state.params))),
                    "opt_state_bytes": int(sum(x.nbytes for x in leaves(state.opt_state))),
                    "frozen_bytes": int(sum(x.nbytes for x in leaves(state.frozen)))}
        finally:
            run.ckpt.close()
            run.writer.close()


def run_method(method: str, cfg: ExperimentConfig, workdir: Path) -> dict:
    from transformer_jax.run import train

    if workdir.exists():
        shutil.rmtree(workdir)
    sizes = state_sizes(cfg)
    rows = []
    t0 = time.perf_counter()
    summary = train(cfg, workdir, progress=False, on_log=lambda step, row: rows.append(row))
    seconds = time.perf_counter() - t0
    tokens = cfg.batch_size * cfg.seq_len
    step_ms = [tokens / r["tokens_per_s"] * 1e3 for r in rows if r.get("tokens_per_s")]
    return {"method": method, "workdir": str(workdir), **sizes,
            "step_ms": statistics.median(step_ms) if step_ms else None,
            "seconds": seconds, "final_train_loss": summary.get("loss"),
            "train_slice_loss_after": summary.get("eval_loss")}


def markdown(result: dict) -> str:
    header = ["method", "trainable params", "optimizer bytes", "step ms", "test loss before",
              "test loss after", "fine-tuning text loss after", "run s"]
    rows = []
    before = result["test_loss_before"]
    for r in result["runs"]:
        if "error" in r:
            rows.append([r["method"], "error: " + r["error"].replace("|", "\\|")] + [""] * 6)
            continue
        rows.append([r["method"], f"{r['trainable_params']:,}", f"{r['opt_state_bytes']:,}",
                     "-" if r["step_ms"] is None else f"{r['step_ms']:.0f}", f"{before:.3f}",
                     f"{r['test_loss_after']:.3f}", f"{r['train_slice_loss_after']:.3f}",
                     f"{r['seconds']:.0f}"])
    lines = [f"Fine-tuning `{result['pretrained']}` ({result['pretrained_params']:,} parameters) on "
             f"the first {1 - HELD_OUT:.0%} of the lines of the {len(result['modules'])} "
             f"validation modules of python_stdlib ({result['train_bytes']:,} bytes), "
             f"{result['steps']} steps of {result['batch']} x {result['seq_len']}; test: their "
             f"last {HELD_OUT:.0%} ({result['test_bytes']:,} bytes). Losses: nats per byte.",
             "", _table(header, rows), "",
             f"Fine-tuning text loss before (pretrained): {result['train_slice_loss_before']:.3f}. "
             f"Total {result['seconds']:.0f} s on {result['machine']}."]
    return "\n".join(lines)


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def machine() -> str:
    """The CPU model and core count (or the accelerator), for the results."""
    import platform

    import jax

    if jax.default_backend() != "cpu":
        return f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 steps a method; without a finished "
                   f"{PRETRAINED}, a 60-step base trained into the quick directory")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps (default 200; quick 20)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of "
                   + ",".join(METHODS))
    p.add_argument("--pretrained", default=None, help=f"the base run (default {PRETRAINED}: "
                   "reused when finished, else trained there)")
    p.add_argument("--out", default=None, help="directory of the runs and the results (default "
                   "runs/finetune_stdlib; quick: runs/finetune_stdlib_quick)")
    p.add_argument("--packing", action="store_true", help="only the packing comparison: "
                   "next-line examples, one per padded row vs packed (no pretrained model)")
    p.add_argument("--packing-epochs", default="padded=2,packed=3", help="--packing: epochs "
                   "of each run (NAME=N, comma-separated; a run left out is skipped)")
    args = p.parse_args(argv)
    if args.packing:
        _, train_docs, test_docs = slices()
        epochs = {k: int(v) for k, v in (x.split("=") for x in args.packing_epochs.split(","))}
        result = packing_comparison(train_docs, test_docs, epochs=epochs)
        result["machine"] = machine()
        print(json.dumps(result, indent=2))
        return {"runs": []}
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    os.chdir(REPO)                          # runs/ relative to the repository
    from transformer_jax.host_memory import tune_malloc_if_cpu
    tune_malloc_if_cpu()                    # as the CLI does, before JAX starts

    import jax

    from transformer_jax.train.checkpoint import load_params

    t_start = time.perf_counter()
    steps = args.steps or (20 if args.quick else 200)
    out = Path(args.out or ("runs/finetune_stdlib_quick" if args.quick else "runs/finetune_stdlib"))
    pretrained = Path(args.pretrained or PRETRAINED)
    quick_base = args.quick and args.pretrained is None and not finished(pretrained)
    if quick_base:
        pretrained = out / "pretrained"
    base = pretrain(pretrained, 60 if quick_base else None)

    paths, train_docs, test_docs = slices()
    print(f"held-out slice: {len(paths)} validation modules, {sum(map(len, train_docs)):,} "
          f"bytes to fine-tune on, {sum(map(len, test_docs)):,} bytes of test text", flush=True)
    batches = 8 if args.quick else 64
    before = text_loss(pretrained, test_docs, batches)
    before_train = text_loss(pretrained, train_docs, 16)
    print(f"pretrained: test loss {before:.3f}, fine-tuning text loss {before_train:.3f}",
          flush=True)
    _, params = load_params(pretrained)
    n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    del params

    runs = []
    for method in methods:
        cfg = method_config(method, steps=steps, init_from=str(pretrained), docs=train_docs)
        print(f"== {method}: {steps} steps, peak lr {cfg.learning_rate:g}", flush=True)
        try:
            r = run_method(method, cfg, out / method)
            r["test_loss_after"] = text_loss(out / method, test_docs, batches)
        except Exception as e:  # noqa: BLE001 - report it in the table, keep going
            import traceback
            traceback.print_exc()
            r = {"method": method, "error": f"{type(e).__name__}: {e}"[:300]}
        runs.append(r)
        if "error" not in r:
            print(f"   {method}: {r['trainable_params']:,} trainable, optimizer "
                  f"{r['opt_state_bytes']:,} bytes, {r['step_ms']:.0f} ms/step; test loss "
                  f"{before:.3f} -> {r['test_loss_after']:.3f} ({r['seconds']:.0f} s)", flush=True)

    cfg = method_config("lora", steps=steps, init_from=str(pretrained), docs=train_docs)
    result = {"experiment": "finetune_stdlib", "quick": args.quick, "pretrained": str(pretrained),
              "pretraining": base, "pretrained_params": n_params, "modules": paths,
              "train_bytes": sum(map(len, train_docs)), "test_bytes": sum(map(len, test_docs)),
              "steps": steps, "batch": cfg.batch_size, "seq_len": cfg.seq_len,
              "test_batches": batches, "test_loss_before": before,
              "train_slice_loss_before": before_train, "runs": runs, "machine": machine(),
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    result["seconds"] = time.perf_counter() - t_start
    result["markdown"] = markdown(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text("# Fine-tuning stdlib_gpt\n\n" + result["markdown"] + "\n")
    print("\n" + result["markdown"])
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'}")
    return result


if __name__ == "__main__":
    sys.exit(0 if all("error" not in r for r in main()["runs"]) else 1)
