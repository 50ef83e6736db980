"""The drift table: every family's experiment trained here and in PyTorch (``compare-torch``),
both float32 runs measured against PyTorch in float64.

Each row is one ``transformer-jax compare-torch --experiment NAME --steps N --set
warmup_steps=5 [--float64-reference]``: the largest relative loss and grad-norm differences
between JAX and PyTorch, each side's against PyTorch in float64 (the runs of
``--f64-steps``), and the median step times. The
Llama row starts ``stdlib_gpt`` with ``--init-from`` a random 4-layer Llama (GQA 4/2) saved
as HF saves it. The default tolerances of ``compare-torch`` come from this table.

Usage::

    python benchmarks/compare_torch_drift.py                   # 30 and 200 steps (~40 min)
    python benchmarks/compare_torch_drift.py --steps 30 --only stdlib_gpt

Writes ``benchmarks/results/compare_torch_drift.{json,md}`` (docs/compare_torch.md carries
the table) and each run's ``compare.png`` under ``runs/compare_torch_drift/``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

EXPERIMENTS = ["stdlib_gpt", "llama", "bert_mlm_stdlib", "bert_classify_stdlib",
               "t5_stdlib_seq2seq", "vit_digits", "transformer_stdlib_seq2seq"]


def llama_dir(path: Path) -> str:
    """A random Llama (4 layers of width 128, 4 query and 2 key/value heads, 320 ids: the
    byte tokenizer fits) as ``save_pretrained`` writes it."""
    import torch
    import transformers

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=320, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)).save_pretrained(path)
    return str(path)


def run(steps: list[int], only: list[str], out: Path, f64_steps: list[int]) -> dict:
    from transformer_jax.compare_torch import compare, describe
    from transformer_jax.train.config import apply_overrides, load_experiment

    rows = []
    with tempfile.TemporaryDirectory(prefix="llama_") as scratch:
        for n in steps:
            for name in only:
                cfg = apply_overrides(load_experiment("stdlib_gpt" if name == "llama" else name),
                                      ["warmup_steps=5"])
                if name == "llama":
                    cfg = cfg.replace(init_from=llama_dir(Path(scratch)))
                start = time.perf_counter()
                s = compare(cfg, out / f"{name}_{n}", steps=n, float64_reference=n in f64_steps,
                            say=lambda line: print(line, flush=True))
                print(f"== {name}, {n} steps ({time.perf_counter() - start:.0f} s)\n{describe(s)}",
                      flush=True)
                rows.append({"experiment": name, "steps": n,
                             "seconds": time.perf_counter() - start,
                             **{k: v for k, v in s.items() if k != "files"}})
    return {"machine": common.machine_info(), "rows": rows, "markdown": render(rows)}


def render(rows: list[dict]) -> str:
    def f64(r, key):
        if f"max_{key}_jax_vs_f64" not in r:
            return "-"
        return f"{r[f'max_{key}_jax_vs_f64']:.1e} / {r[f'max_{key}_torch_vs_f64']:.1e}"

    table = [[f"`{r['experiment']}`", r["steps"], f"{r['max_loss_diff']:.1e}", f64(r, "loss"),
              f"{r['max_grad_norm_diff']:.1e}", f64(r, "grad_norm"), f"{r['max_lr_diff']:.0e}",
              f"{r['ms_jax']:.0f} / {r['ms_torch']:.0f}", f"{r['speed_ratio']:.2f}x"]
             for r in rows]
    return common.md_table(["experiment", "steps", "loss: JAX vs PyTorch",
                            "loss vs float64: JAX / PyTorch", "grad norm: JAX vs PyTorch",
                            "grad norm vs float64: JAX / PyTorch", "learning rate",
                            "ms/step JAX / PyTorch", "JAX speed"], table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="30,200", help="comma-separated run lengths")
    p.add_argument("--only", default=",".join(EXPERIMENTS), help="comma-separated subset of "
                   + ",".join(EXPERIMENTS))
    p.add_argument("--f64-steps", default="30", help="the run lengths that also train PyTorch "
                   "in float64 (comma-separated; '' for none)")
    p.add_argument("--out", default="runs/compare_torch_drift", help="where the runs go")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = [e for e in only if e not in EXPERIMENTS]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {EXPERIMENTS}")
    common.setup_process()
    result = run([int(s) for s in args.steps.split(",")], only, Path(args.out),
                 [int(s) for s in args.f64_steps.split(",") if s])
    common.report("compare_torch_drift", "JAX against PyTorch, step by step", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
