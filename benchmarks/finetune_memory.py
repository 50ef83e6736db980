"""Fine-tuning memory: full fine-tuning vs LoRA, QLoRA (NF4) and prefix tuning of GPT-2 124M.

For each method the train state is built as a fine-tuning run builds it
(``create_train_state(..., partition=ParamSplit(...).split)``: the adapters train, the rest
is ``TrainState.frozen``, stored NF4 under QLoRA), abstractly (``jax.eval_shape``: nothing
is allocated for the sizes), and the train step is compiled with the state donated, as the
training loop compiles it (``train/step.py``'s ``compile_train_step``: ``jax.jit(step, donate_argnums=(0,))``;
one device, so no shardings). Reported per method:

* trainable parameters (the leaves of ``state.params``);
* optimizer-state bytes: the ``nbytes`` of every ``state.opt_state`` leaf (AdamW in fp32:
  2 x 4 bytes per trainable parameter, plus two int32 step counts);
* parameter bytes as stored: trainable + frozen (NF4: 4 bits a weight + one fp32 absmax
  per block of 64; the embeddings, biases and norms stay fp32);
* the compiled step's peak memory from XLA's ``memory_analysis()``: argument + output +
  temporaries - aliased (the donated state's buffers are reused for the new state), at
  B=2, T=128 (``--batch``, ``--seq``);
* without ``--quick``: the median step time at that batch, the methods run alternating in
  this process (``common.alternate``) on real (randomly initialised) states.

The model is ``GPTConfig.preset("gpt2")`` with random weights and dropout 0; LoRA has rank
8 and alpha 16 on ``attn/(query|value)`` (the PEFT default for GPT-2) and on ``attn/|mlp/``
(every projection); QLoRA is the first with ``lora.quantize="nf4"`` (needs
``transformer_jax/layers/quant.py``); prefix tuning has 16 tokens. The ratios printed:
LoRA (q, v) optimizer bytes / full fine-tuning's, and each method's peak / full's.
``--quick`` uses a small GPT (2 layers, width 256, vocabulary 512, T=64) and skips the
timing; ``tests/test_benchmarks.py`` runs it.

Measured here (2026-12-02, AMD EPYC avx512, 2 cores, GPT-2 124M, B=2, T=128; MiB)::

  method                trainable  optimizer  params (stored)  peak step  temp  step ms
  full fine-tuning    124,439,808      949.4            474.7    2,377.3   953     2797
  LoRA q,v r=8            294,912        2.3            475.8      765.0   287     1643
  LoRA attn+mlp r=8     1,327,104       10.1            479.8      867.9   378     1753
  QLoRA-NF4 q,v r=8       294,912        2.3            197.4      803.8   604     1680
  prefix, 16 tokens       294,912        2.3            475.8      762.5   284     1633

LoRA's Adam state is 0.24% of full fine-tuning's and its step's peak 32% of it. QLoRA
stores the frozen base in 196 MiB (41% of fp32: the NF4 kernels take ~46 MiB, the fp32
token embedding alone 147 MiB), but its step's temporaries grow by 317 MiB, about the 85M
kernel weights in fp32 (324 MiB: presumably the dequantized kernels, kept for the backward
pass), so with XLA:CPU its peak is above plain LoRA's. Without the weight gradients an
adapter step takes ~60% of a full step's time (load average 1-5 during the run).

Usage::

    python benchmarks/finetune_memory.py            # GPT-2 124M, with step times (~4 min here)
    python benchmarks/finetune_memory.py --quick    # small GPT, sizes only (~30 s)
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax.layers.lora import LoraConfig  # noqa: E402
from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train import finetune  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402

#: AdamW as in benchmarks/train.py (fp32 moments)
OPT = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, clip=1.0)
QV, ALL = "attn/(query|value)", "attn/|mlp/"


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    label: str
    overrides: dict                 # model config fields on top of the base config

    @property
    def adapted(self) -> bool:
        return bool(self.overrides)


def methods() -> list[Method]:
    """The methods compared; QLoRA and prefix tuning only where the library has them."""
    out = [Method("full", "full fine-tuning", {}),
           Method("lora_qv", f"LoRA r=8 {QV}", {"lora": LoraConfig(rank=8, alpha=16, targets=QV)}),
           Method("lora_all", f"LoRA r=8 {ALL}", {"lora": LoraConfig(rank=8, alpha=16, targets=ALL)})]
    if importlib.util.find_spec("transformer_jax.layers.quant") is not None:
        out.append(Method("qlora_nf4", f"QLoRA-NF4 r=8 {QV}",
                          {"lora": LoraConfig(rank=8, alpha=16, targets=QV, quantize="nf4")}))
    if any(f.name == "prefix_tokens" for f in dataclasses.fields(GPTConfig)):
        out.append(Method("prefix16", "prefix tuning, 16 tokens", {"prefix_tokens": 16}))
    return out


def base_config(quick: bool) -> GPTConfig:
    small = dict(vocab_size=512, max_len=128, num_layers=2, num_heads=4, d_model=256) if quick else {}
    return GPTConfig.preset("gpt2", dropout_rate=0.0, attention_dropout_rate=0.0, **small)


def optimizer():
    return make_optimizer(schedule=constant(OPT["lr"]), b1=OPT["b1"], b2=OPT["b2"],
                          eps=OPT["eps"], weight_decay=OPT["weight_decay"], clip_norm=OPT["clip"])


def nbytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree_util.tree_leaves(tree)))


def count(tree: Any) -> int:
    return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree)))


class Built:
    """One method's model, optimizer, state factory and jitted (donating) step."""

    def __init__(self, method: Method, base: GPTConfig, batch: int, seq: int):
        self.method = method
        self.config = base.replace(**method.overrides)
        self.model = GPT(self.config)
        self.tx = optimizer()
        split = finetune.ParamSplit(lora=self.config.lora) if method.adapted else None
        self.partition = None if split is None else split.split
        self.batch_shape = (batch, seq)
        self.step = jax.jit(make_train_step(), donate_argnums=(0,))

    def create(self, seed: int = 0):
        ids = jnp.zeros((1, self.batch_shape[1]), jnp.int32)
        return create_train_state(self.model, self.tx, jax.random.PRNGKey(seed), ids,
                                  partition=self.partition)

    def abstract_batch(self) -> dict:
        ids = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32)
        return {"inputs": ids, "targets": ids,
                "weights": jax.ShapeDtypeStruct(self.batch_shape, jnp.float32)}


def measure_sizes(built: Built) -> dict[str, Any]:
    """Sizes from the abstract state, and the compiled step's memory analysis."""
    state = jax.eval_shape(built.create)
    record: dict[str, Any] = {
        "name": built.method.name, "label": built.method.label,
        "total_params": built.config.num_params() if not built.method.adapted else None,
        "trainable_params": count(state.params),
        "frozen_params_stored": count(state.frozen) if state.frozen is not None else 0,
        "opt_state_bytes": nbytes(state.opt_state),
        "trainable_bytes": nbytes(state.params),
        "frozen_bytes": nbytes(state.frozen) if state.frozen is not None else 0,
        "opt_state_leaves": len(jax.tree_util.tree_leaves(state.opt_state)),
    }
    record["param_bytes"] = record["trainable_bytes"] + record["frozen_bytes"]
    record["opt_state_extra_bytes"] = record["opt_state_bytes"] - 8 * record["trainable_params"]
    t0 = time.perf_counter()
    compiled = built.step.lower(state, built.abstract_batch()).compile()
    record["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    parts = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    record["memory"] = parts
    record["peak_bytes"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    built.compiled = compiled
    return record


def time_steps(builts: list[Built], rounds: int, warmup: int, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per train step of each method on real states, alternating (common.alternate)."""
    rng = np.random.default_rng(seed)
    b, t = builts[0].batch_shape
    vocab = builts[0].config.vocab_size
    ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
             "weights": jnp.ones((b, t), jnp.float32)}
    fns = {}
    for built in builts:
        holder = {"state": jax.jit(built.create)(seed)}
        call = built.compiled if hasattr(built, "compiled") else built.step

        def run(holder=holder, call=call):
            holder["state"], metrics = call(holder["state"], batch)
            jax.block_until_ready(metrics)
        fns[built.method.name] = run
    return common.alternate(fns, rounds=rounds, warmup=warmup)


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def cell(text: str) -> str:
    """Text for a markdown table cell (a regex's ``|`` would split the cell)."""
    return text.replace("|", "\\|")


def markdown(result: dict) -> str:
    records = result["records"]
    full = next((r for r in records if r["name"] == "full" and "error" not in r), None)
    header = ["method", "trainable params", "optimizer MiB", "params MiB (trainable + frozen)",
              "peak step MiB", "peak / full", "temp MiB", "step ms", "compile s"]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([cell(r["label"]), "error: " + cell(r["error"])] + [""] * (len(header) - 2))
            continue
        ratio = f"{r['peak_bytes'] / full['peak_bytes']:.2f}" if full else "-"
        step = common.fmt(r.get("step_s") and r["step_s"] * 1e3, ".0f")
        rows.append([cell(r["label"]), f"{r['trainable_params']:,}", mib(r["opt_state_bytes"]),
                     f"{mib(r['param_bytes'])} ({mib(r['trainable_bytes'])} + {mib(r['frozen_bytes'])})",
                     mib(r["peak_bytes"]), ratio, mib(r["memory"]["temp"]), step,
                     f"{r['compile_s']:.1f}"])
    m = result["machine"]
    b, t = result["batch"], result["seq"]
    text = [f"Model: {result['model']}; train step at B={b}, T={t}; AdamW fp32 "
            f"(two moments); {m['cpu']} ({m['cpu_isa']}), {m['cpu_count']} cores, "
            f"{m['backend']}.", "", common.md_table(header, rows), ""]
    ratios = result["ratios"]
    if "lora_qv_over_full_opt" in ratios:
        text.append(f"LoRA (`{QV}`) optimizer bytes / full fine-tuning's: "
                    f"{ratios['lora_qv_over_full_opt']:.3%}.")
    for name, value in ratios.get("peak_over_full", {}).items():
        text.append(f"peak {name} / peak full: {value:.3f}")
    for name, value in ratios.get("step_time_over_full", {}).items():
        text.append(f"step time {name} / step time full: {value:.2f}")
    text += ["", "peak = argument + output + temp - alias of the compiled step "
                 "(`memory_analysis()`), the state donated. Optimizer bytes = "
                 "8 x trainable params + 8 (two int32 step counts)."]
    if result.get("timed"):
        text.append(f"step ms: median of {result['rounds']} alternating rounds, after "
                    f"{result['warmup']} warm-up step(s) each.")
    return "\n".join(text)


def run(args) -> dict[str, Any]:
    base = base_config(args.quick)
    seq = args.seq or (64 if args.quick else 128)
    built, records = [], []
    print(f"# finetune_memory: {'quick' if args.quick else 'gpt2'} model, "
          f"{base.num_params():,} params, B={args.batch}, T={seq}", flush=True)
    wanted = methods()
    if args.methods:
        names = args.methods.split(",")
        unknown = sorted(set(names) - {m.name for m in wanted})
        if unknown:
            raise SystemExit(f"--methods: unknown or unavailable {unknown}; choose from "
                             f"{[m.name for m in wanted]}")
        wanted = [m for m in wanted if m.name in names]
    for method in wanted:
        try:
            b = Built(method, base, args.batch, seq)
            r = measure_sizes(b)
            built.append(b)
        except Exception as e:  # noqa: BLE001 - report and keep going
            r = {"name": method.name, "label": method.label,
                 "error": f"{type(e).__name__}: {e}"[:300]}
        records.append(r)
        if "error" in r:
            print(f"  {method.label}: {r['error']}", flush=True)
        else:
            print(f"  {method.label}: {r['trainable_params']:,} trainable, optimizer "
                  f"{mib(r['opt_state_bytes'])} MiB, params {mib(r['param_bytes'])} MiB, peak "
                  f"{mib(r['peak_bytes'])} MiB (compiled in {r['compile_s']:.1f} s)", flush=True)
    timed = not args.quick and args.rounds > 0 and built
    if timed:
        times = time_steps(built, rounds=args.rounds, warmup=args.warmup)
        for r in records:
            if r["name"] in times:
                r["times_s"] = times[r["name"]]
                r["step_s"] = common.median(times[r["name"]])
                print(f"  {r['label']}: {r['step_s'] * 1e3:.0f} ms/step", flush=True)
    ok = {r["name"]: r for r in records if "error" not in r}
    ratios: dict[str, Any] = {}
    if "full" in ok:
        full = ok["full"]
        if "lora_qv" in ok:
            ratios["lora_qv_over_full_opt"] = ok["lora_qv"]["opt_state_bytes"] / full["opt_state_bytes"]
        ratios["peak_over_full"] = {n: r["peak_bytes"] / full["peak_bytes"]
                                    for n, r in ok.items() if n != "full"}
        if timed:
            ratios["step_time_over_full"] = {n: r["step_s"] / full["step_s"]
                                             for n, r in ok.items() if n != "full" and "step_s" in r}
    result = {"benchmark": "finetune_memory", "quick": args.quick, "machine": common.machine_info(),
              "model": ("small GPT (2 layers, width 256, vocab 512)" if args.quick
                        else "GPT-2 124M (preset gpt2, random weights)"),
              "model_config": base.to_dict(), "batch": args.batch, "seq": seq,
              "optimizer": OPT, "timed": bool(timed), "rounds": args.rounds,
              "warmup": args.warmup, "records": records, "ratios": ratios}
    result["markdown"] = markdown(result)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small GPT, sizes only (no timing)")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of full,lora_qv,lora_all,qlora_nf4,prefix16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="default 128 (quick: 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed alternating rounds (0: none)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each method first")
    p.add_argument("--out", type=Path, default=None,
                   help="output stem (default benchmarks/results/finetune_memory[_quick])")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    out = args.out or common.RESULTS_DIR / ("finetune_memory_quick" if args.quick else "finetune_memory")
    print("\n" + result["markdown"])
    title = "Fine-tuning memory" + (" (quick)" if args.quick else "")
    js, md = common.write_results(out.name, result, f"# {title}\n\n" + result["markdown"],
                                  out_dir=out.parent)
    print(f"\nwrote {js} and {md}")
    return result


if __name__ == "__main__":
    sys.exit(0 if all("error" not in r for r in main()["records"]) else 1)
