"""The matmul floor of a train step: the step's own dots, alone, in XLA and in PyTorch.

A train step on a CPU is bound by its matrix products. This benchmark asks how fast the
GPT step could be with the matmul kernels each library has here, whatever the rest of the
step costs:

1. compile our jitted GPT train step (layers unrolled) and read every ``dot`` out of its
   optimised HLO, operand shapes and dimension numbers, also the dots inside YNNPACK
   fusions (``compiled_dots``). A dot inside a loop body would count once, so the run
   checks that the dots' FLOPs are within 25% of the model FLOPs;
2. run exactly those dots, and nothing else, as one jitted XLA program (``xla_dots``).
   Every dot gets its own operands so none can be merged, and the program's own HLO is read
   back to check that it holds the same dots;
3. run the same dots with ``torch.matmul`` on permuted views (no copies where the strides
   allow), one after another (``torch_dots``);
4. alternate four calls in this process: our step, the XLA dots, HF GPT-2's eager step
   (the ``benchmarks/train.py`` peer, same config, batch and AdamW) and the torch dots.

What it reports:

* ``ours step / XLA dots``: how much longer our step takes than its matmuls alone;
  ``HF step / torch dots`` puts HF's step against the same (our step's) dots in torch,
  a near stand-in for its own matmuls (HF's attention is one fused SDPA kernel).
* ``HF eager step / XLA dots``: the highest ours/eager speedup that these XLA kernels
  allow. Even if everything outside the dots cost nothing, our step could not be faster
  than its dots alone.
* ``torch dots / XLA dots``: the two libraries on identical work. The XLA program may
  overlap independent dots (as the step does) and the torch dots run one after another
  (as in eager mode), so this compares kernels and scheduling together. Each dot kind
  reuses about sqrt(count) operand arrays, warmer in cache than in a step: both floors
  are optimistic.

Usage::

    python benchmarks/matmul_floor.py                # GPT 6L/384, T=256, B=8, V=8192 (~1 min)
    python benchmarks/matmul_floor.py --rounds 9

Results: ``benchmarks/results/matmul_floor.{json,md}``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax.train.monitor import measure_matmul_peak  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Dot:
    """One HLO dot: operand shapes and dimension numbers (as ``lax.dot_general`` takes them)."""
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]

    @property
    def dimension_numbers(self):
        return ((self.lhs_contract, self.rhs_contract), (self.lhs_batch, self.rhs_batch))

    @property
    def flops(self) -> int:
        """2 · batch · M · N · K."""
        lhs_size, rhs_size = math.prod(self.lhs), math.prod(self.rhs)
        batch = math.prod(self.lhs[d] for d in self.lhs_batch)
        k = math.prod(self.lhs[d] for d in self.lhs_contract)
        return 2 * lhs_size * (rhs_size // (batch * k))

    def describe(self) -> str:
        batch = f" batch {list(self.lhs_batch)}/{list(self.rhs_batch)}" if self.lhs_batch else ""
        return (f"{list(self.lhs)}·{list(self.rhs)} contract {list(self.lhs_contract)}/"
                f"{list(self.rhs_contract)}{batch}")


# ----------------------------------------------------------------------------- HLO

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_DOT = re.compile(r"=\s*\w+\[[\d,]*\]\S*\s+dot\(\s*(?:\w+\[[\d,]*\]\S*\s+)?%?([\w.\-]+),\s*"
                  r"(?:\w+\[[\d,]*\]\S*\s+)?%?([\w.\-]+)\)(.*)")
_DIMS = re.compile(r"(lhs_batch_dims|rhs_batch_dims|lhs_contracting_dims|rhs_contracting_dims)"
                   r"=\{([\d,]*)\}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def hlo_dots(hlo_text: str) -> Counter:
    """Every ``dot`` instruction of an HLO module's text, fused or not: ``Counter[Dot]``.

    Operand shapes come from the operands' definitions (instruction names are unique in a
    module). Raises ValueError when a dot's operand is not defined in the text."""
    shapes: dict[str, tuple[int, ...]] = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            shapes[m.group(1)] = _ints(m.group(2))
    dots: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _DOT.search(line)
        if not m:
            continue
        lhs, rhs, attrs = m.groups()
        if lhs not in shapes or rhs not in shapes:
            raise ValueError(f"dot operand {lhs if lhs not in shapes else rhs!r} has no "
                             f"definition in the HLO text; line: {line.strip()[:200]}")
        dims = dict(_DIMS.findall(attrs))
        dots[Dot(shapes[lhs], shapes[rhs], _ints(dims.get("lhs_batch_dims", "")),
                 _ints(dims.get("rhs_batch_dims", "")), _ints(dims.get("lhs_contracting_dims", "")),
                 _ints(dims.get("rhs_contracting_dims", "")))] += 1
    return dots


def compiled_dots(jitted, *args) -> Counter:
    """The dots of ``jitted``'s optimised HLO for ``args``."""
    return hlo_dots(jitted.lower(*args).compile().as_text())


# ----------------------------------------------------------------------------- the dots alone

def _operand_pools(dots: Counter, seed: int):
    """Random operands for each dot kind: ceil(sqrt(count)) arrays per side, so that every
    one of the ``count`` dots gets a distinct (lhs, rhs) pair and none can be CSE'd."""
    rng = np.random.default_rng(seed)
    pools = []
    for dot, count in dots.items():
        p = math.isqrt(count - 1) + 1
        lhs = [rng.standard_normal(dot.lhs, np.float32) for _ in range(p)]
        rhs = [rng.standard_normal(dot.rhs, np.float32) for _ in range(p)]
        pools.append((dot, count, p, lhs, rhs))
    return pools


def xla_dots(dots: Counter, seed: int = 0) -> tuple[Callable[[], Any], Callable, tuple]:
    """(a call that runs all the dots once and waits, the jitted program, its arguments)."""
    pools = _operand_pools(dots, seed)
    args = tuple(([jax.numpy.asarray(a) for a in lhs], [jax.numpy.asarray(b) for b in rhs])
                 for _, _, _, lhs, rhs in pools)
    plan = [(dot, count, p) for dot, count, p, _, _ in pools]

    def program(operands):
        outs = []
        for (dot, count, p), (lhs, rhs) in zip(plan, operands):
            for i in range(count):
                outs.append(jax.lax.dot_general(lhs[i // p], rhs[i % p], dot.dimension_numbers))
        return outs

    fn = jax.jit(program)

    def call():
        jax.block_until_ready(fn(args))
    return call, fn, (args,)


def torch_dot(torch, dot: Dot, lhs, rhs):
    """``lax.dot_general`` in torch: batch dims first, then lhs free, then rhs free, as XLA
    orders a dot's output. Operands are permuted views (reshape copies only where the
    strides don't allow a view); ``torch.matmul`` reads transposed strides itself."""
    lf = [d for d in range(len(dot.lhs)) if d not in dot.lhs_batch + dot.lhs_contract]
    rf = [d for d in range(len(dot.rhs)) if d not in dot.rhs_batch + dot.rhs_contract]
    batch = [dot.lhs[d] for d in dot.lhs_batch]
    m, n = math.prod(dot.lhs[d] for d in lf), math.prod(dot.rhs[d] for d in rf)
    k = math.prod(dot.lhs[d] for d in dot.lhs_contract)
    a = lhs.permute(*dot.lhs_batch, *lf, *dot.lhs_contract).reshape(*batch, m, k)
    b = rhs.permute(*dot.rhs_batch, *dot.rhs_contract, *rf).reshape(*batch, k, n)
    out = torch.matmul(a, b)
    return out.reshape(*batch, *(dot.lhs[d] for d in lf), *(dot.rhs[d] for d in rf))


def torch_dots(dots: Counter, seed: int = 0) -> Callable[[], Any]:
    import torch
    pools = [(dot, count, p, [torch.from_numpy(a) for a in lhs], [torch.from_numpy(b) for b in rhs])
             for dot, count, p, lhs, rhs in _operand_pools(dots, seed)]

    def call():
        with torch.no_grad():
            for dot, count, p, lhs, rhs in pools:
                for i in range(count):
                    torch_dot(torch, dot, lhs[i // p], rhs[i % p])
    return call


# ----------------------------------------------------------------------------- run

def run(args) -> dict[str, Any]:
    import torch

    from benchmarks import train

    case = train.gpt_case(args.layers, args.width, args.heads, args.seq, args.batch, args.vocab)
    torch.manual_seed(0)
    built = case.build(np.random.default_rng(0))
    step, state, ours = train.our_train_step(built)
    dots = compiled_dots(step, state, built.batch)
    flops = sum(d.flops * c for d, c in dots.items())
    if not 0.75 <= flops / built.flops <= 1.25:
        raise RuntimeError(
            f"the step's dots add up to {flops / 1e9:.1f} GFLOP against {built.flops / 1e9:.1f} "
            "model GFLOP: some dots were not read (a loop body counts once: use unrolled "
            "layers) or the HLO text has a form hlo_dots does not parse")
    del state
    xla_call, xla_fn, xla_args = xla_dots(dots)
    floor_dots = compiled_dots(xla_fn, *xla_args)
    if floor_dots != dots:
        missing, extra = dots - floor_dots, floor_dots - dots
        raise RuntimeError("XLA compiled the dots-only program into other dots than the step's: "
                           f"missing {dict(missing)}, extra {dict(extra)}")
    hf = built.hf_model
    fns = {"ours_step": ours, "xla_dots": xla_call,
           "hf_eager_step": train._hf_step_fn(hf, hf, train.hf_adamw(hf), built.hf_inputs),
           "torch_dots": torch_dots(dots)}
    peak = measure_matmul_peak()
    times = common.alternate(fns, rounds=args.rounds, warmup=args.warmup)
    t = {k: common.median(v) for k, v in times.items()}
    kinds = sorted(dots.items(), key=lambda dc: -dc[0].flops * dc[1])
    result = {
        "benchmark": "matmul_floor", "machine": common.machine_info(), "case": case.name,
        "peak_flops": peak, "rounds": args.rounds, "dot_count": sum(dots.values()),
        "dot_kinds": [{"dot": d.describe(), "count": c, "gflop": d.flops * c / 1e9}
                      for d, c in kinds],
        "dot_flops": flops, "model_flops_per_step": built.flops,
        "median_s": t, "times_s": times,
        "ratios": {"ours_step_over_xla_dots": t["ours_step"] / t["xla_dots"],
                   "hf_step_over_torch_dots": t["hf_eager_step"] / t["torch_dots"],
                   "max_ours_over_eager": t["hf_eager_step"] / t["xla_dots"],
                   "ours_over_eager": t["hf_eager_step"] / t["ours_step"],
                   "torch_dots_over_xla_dots": t["torch_dots"] / t["xla_dots"]},
    }
    result["markdown"] = markdown(result)
    return result


def markdown(r: dict[str, Any]) -> str:
    t, q = r["median_s"], r["ratios"]
    gf = r["dot_flops"] / 1e9

    def row(name, key, dots_only):
        rate = f"{gf / t[key]:.0f}" if dots_only else "-"
        return [name, f"{t[key] * 1e3:,.0f}", rate]
    table = common.md_table(["what", "ms", "dot GFLOP/s"], [
        row("ours: the train step", "ours_step", False),
        row("ours: the step's dots alone (XLA)", "xla_dots", True),
        row("HF eager: the train step", "hf_eager_step", False),
        row("the same dots alone (torch)", "torch_dots", True)])
    peak = r["peak_flops"] / 1e9
    return "\n".join([
        f"{r['case']}: {r['dot_count']} dots, {gf:.1f} GFLOP per step (model FLOPs "
        f"{r['model_flops_per_step'] / 1e9:.1f}); fp32 matmul peak {peak:.0f} GFLOP/s.",
        "", table, "",
        f"- ours/eager now: {q['ours_over_eager']:.2f}x. The most the XLA kernels allow "
        f"(HF eager step / the XLA dots alone): {q['max_ours_over_eager']:.2f}x.",
        f"- Step over the dots alone: ours {q['ours_step_over_xla_dots']:.2f}x, HF eager "
        f"{q['hf_step_over_torch_dots']:.2f}x (against our step's dots in torch; HF's own "
        "attention is a fused SDPA kernel).",
        f"- The same dots: torch / XLA time {q['torch_dots_over_xla_dots']:.2f} (> 1: the XLA "
        "program is faster; it may overlap independent dots, torch runs them in order).",
    ])


QUICK_ARGS = ["--layers", "2", "--width", "128", "--heads", "4", "--seq", "128", "--vocab", "259",
              "--rounds", "3", "--warmup", "1"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=7, help="timed alternating rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each first")
    p.add_argument("--out", default="matmul_floor", help="stem of the result files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.report(args.out, "Matmul floor", run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
