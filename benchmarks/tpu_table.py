"""The TPU table: every TPU experiment compiled for the TPU types it is meant for.

Each row is one ``transformer-jax compile`` (the real TPU compiler, libtpu, on this host;
no TPU needed): per-device memory against the type's HBM, the attention path, the
collectives per step, the roofline bound of the compiled program (its FLOPs and HBM bytes
against the chip's peaks: a lower bound on the step time, not a measurement) and the step
time estimated at 40% MFU (the compile times are in the JSON). A row whose experiment cannot
be built on this host (e.g. its dataset is not prepared here) is listed as skipped, with why. Two more rows show GPT-2 large on a v2-8: data parallel does not fit the 8 GiB
cores, FSDP does.

Usage::

    python benchmarks/tpu_table.py               # all rows (~35 min on 2 CPU cores)
    python benchmarks/tpu_table.py --only gpt2_124m_tpu_v5e_1

Writes ``benchmarks/results/tpu_table.{json,md}``; docs/tpu.md carries the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

# (experiment, TPU type, mesh or None for the experiment's, --set overrides, label)
ROWS = [
    ("gpt2_124m_tpu_v5e_1", "v5e-1", None, [], ""),
    ("gpt2_124m_tpu_v5e_1", "v6e-1", None, [], ""),
    ("vit_b16_tpu_v5e_1", "v5e-1", None, [], ""),
    ("vit_b16_tpu_v5e_1", "v6e-1", None, [], ""),
    ("gpt2_124m_tpu_v5e_8", "v5e-8", None, [], ""),
    ("gpt2_124m_tpu_v3_8", "v3-8", None, [], ""),
    ("gpt2_124m_tpu_v3_8", "v2-8", None, [], ""),
    ("vit_b16_tpu_v3_8", "v3-8", None, [], ""),
    ("vit_b16_tpu_v3_8", "v2-8", None, [], ""),
    ("gpt2_124m_tpu_v4_32", "v4-32", None, [], ""),
    ("vit_b16_tpu_v4_32", "v4-32", None, [], ""),
    ("llama3_8b_qlora_tpu_v5e_1", "v5e-1", None, [], ""),
    ("llama3_8b_qlora_tpu_v5e_1", "v6e-1", None, [], ""),
    ("llama3_8b_lora_tpu_v5e_8", "v5e-8", None, [], ""),
    ("llama3_2_1b_finetune_tpu_v5e_1", "v5e-1", None, [], ""),
    ("gpt2_124m_tpu_v3_8", "v2-8", "data=-1", ["model_preset=gpt2-large"], "GPT-2 large"),
    ("gpt2_124m_tpu_v3_8", "v2-8", "fsdp=-1", ["model_preset=gpt2-large"], "GPT-2 large"),
]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def render(rows: list[dict]) -> str:
    """The markdown table of the rows :func:`run` collects."""
    table = []
    for r in rows:
        coll = ", ".join(f"{k} x{v['count']} ({v['bytes'] / 2**20:.0f} MiB)"
                         for k, v in r["collectives"].items()) or "none"
        if r["out_of_memory"] and not r["collectives"]:
            coll = "(no program: out of HBM)"
        name = r["experiment"] + (f" ({r['label']})" if r["label"] else "")
        table.append([f"`{name}`", r["tpu"], r["mesh"],
                      f"{gib(r['per_device_bytes'])} / {r['hbm_bytes'] / 2**30:.0f}",
                      "yes" if r["fits"] else "**no**", r["attention"].split(" (")[0], coll,
                      (f"{r['roofline_seconds'] * 1e3:.0f} ms ({r['roofline_bound']})"
                       if r["fits"] and r.get("roofline_bound") else "-"),
                      f"{r['estimated_step_seconds'] * 1e3:.0f} ms" if r["fits"] else "-"])
    return common.md_table(["experiment", "TPU", "mesh", "GiB per device / HBM", "fits",
                            "attention", "collectives per step", "roofline bound (binds)",
                            "step (est., 40% MFU)"], table)


def run(only: str | None = None) -> dict:
    from transformer_jax.aot import compile_experiment
    from transformer_jax.errors import UserError
    from transformer_jax.train.config import apply_overrides, load_experiment

    rows, skipped = [], []
    for experiment, tpu, mesh, overrides, label in ROWS:
        if only and experiment != only:
            continue
        cfg = apply_overrides(load_experiment(experiment), overrides)
        start = time.perf_counter()
        try:
            r = compile_experiment(cfg, tpu, mesh=mesh)
        except UserError as e:
            print(f"{experiment} {tpu}: skipped ({e})", flush=True)
            skipped.append({"experiment": experiment, "tpu": tpu, "why": str(e)})
            continue
        print(f"{experiment} {tpu} {r.mesh}: {gib(r.per_device_bytes)} / {gib(r.hbm_bytes)} "
              f"GiB ({time.perf_counter() - start:.0f} s)", flush=True)
        rows.append({"label": label, "overrides": overrides, **r.to_dict()})
    import jax
    import libtpu
    return {"machine": common.machine_info(), "jax": jax.__version__,
            "libtpu": libtpu.__version__, "rows": rows, "skipped": skipped,
            "markdown": render(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="one experiment's rows")
    args = p.parse_args(argv)
    common.report("tpu_table", "TPU experiments compiled for their TPU types", run(args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
