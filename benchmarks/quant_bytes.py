"""Parameter bytes of GPT-2 124M's block kernels: fp32, bf16, int8, NF4 and NF4 + double quant.

The kernels are those QLoRA keeps quantized (``layers/quant.py``'s ``DEFAULT_TARGETS``): the
attention (query, key, value, out) and feed-forward (wi, wo) projections of the 12 blocks,
85M of the model's 124M parameters. The model is built with ``jax.eval_shape`` (no weights
are materialised); each format's bytes are those of the very arrays ``quantize_params``
returns for it (its ``eval_shape``: their shapes and dtypes), scales and absmax leaves
included. The rest of the model (embeddings, norms, biases) stays fp32 and is reported apart.
No time is measured; the machine is recorded as for the other benchmarks.

Usage::

    python benchmarks/quant_bytes.py            # GPT-2 124M (a few seconds)
    python benchmarks/quant_bytes.py --smoke    # the tiny preset, also quantized for real
                                                # (the real arrays' bytes must match)
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from transformer_jax.layers import quant  # noqa: E402
from transformer_jax.layers.lora import LoraConfig  # noqa: E402
from transformer_jax.models import GPT, GPTConfig  # noqa: E402

#: (row name, LoraConfig fields) of the quantized formats; fp32 / bf16 are the kernels as such
FORMATS = (("int8", dict(quantize="int8")), ("nf4", dict(quantize="nf4")),
           ("nf4+dq", dict(quantize="nf4", double_quant=True)))


def block_leaves(params: dict, targets: str = quant.DEFAULT_TARGETS) -> dict:
    """The ``kernel`` (or stored ``kernel_*``) leaves of the targeted Dense modules, by path."""
    pattern = re.compile(targets)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(k.key) for k in path]
        if (names[-1] == "kernel" or names[-1] in quant.STORED_NAMES) \
                and pattern.search("/".join(names[:-1])):
            out["/".join(names)] = leaf
    return out


def shapes(cfg: GPTConfig) -> dict:
    """The model's unboxed parameters as ``jax.ShapeDtypeStruct`` s."""
    model = GPT(cfg)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                                  jnp.zeros((1, 8), jnp.int32)))
    return nn.meta.unbox(variables["params"])


def measure(params: dict, block: int) -> dict[str, dict[str, int]]:
    """Per format: ``param_bytes`` of the block kernels' leaves in that format."""
    trees = {"fp32": params,
             "bf16": jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                                            params)}
    for name, fields in FORMATS:
        config = LoraConfig(quantize_block=block, **fields)
        trees[name] = jax.eval_shape(lambda p, c=config: quant.quantize_params(p, c), params)
    return {name: quant.param_bytes(block_leaves(tree)) for name, tree in trees.items()}


def run(args) -> dict:
    cfg = GPTConfig.preset(args.preset)
    params = shapes(cfg)
    kernels = block_leaves(params)
    n = sum(leaf.size for leaf in kernels.values())
    every = quant.param_bytes(params)["total"]
    rest = every - quant.param_bytes(kernels)["total"]
    print(f"# quant bytes: {args.preset} ({cfg.num_params() / 1e6:.1f}M params), "
          f"{len(kernels)} block kernels, {n / 1e6:.2f}M params, block {args.block}", flush=True)
    measured = measure(params, args.block)
    rows = []
    for name, b in measured.items():
        rows.append({"format": name, "bytes": b["total"],
                     "bytes_by_dtype": {k: v for k, v in b.items() if k != "total"},
                     "bits_per_param": 8 * b["total"] / n,
                     "model_bytes": b["total"] + rest})
    by = {r["format"]: r["bytes"] for r in rows}
    ratios = {"bf16_over_nf4": by["bf16"] / by["nf4"], "bf16_over_nf4dq": by["bf16"] / by["nf4+dq"],
              "fp32_over_nf4": by["fp32"] / by["nf4"], "bf16_over_int8": by["bf16"] / by["int8"]}
    checked = None
    if args.smoke:     # the same bytes from really quantized arrays
        real = GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
        real = nn.meta.unbox(real)
        checked = {}
        for name, fields in FORMATS:
            stored = quant.quantize_params(real, LoraConfig(quantize_block=args.block, **fields))
            checked[name] = quant.param_bytes(block_leaves(stored))["total"] == by[name]
        if not all(checked.values()):
            raise AssertionError(f"eval_shape bytes differ from the real arrays': {checked}")
    header = ["format", "block kernels MiB", "bits / param", "vs fp32", "vs bf16",
              "whole model MiB", "dtypes (MiB)"]
    body = [[r["format"], f"{r['bytes'] / 2**20:.2f}", f"{r['bits_per_param']:.3f}",
             f"{by['fp32'] / r['bytes']:.2f}x", f"{by['bf16'] / r['bytes']:.2f}x",
             f"{r['model_bytes'] / 2**20:.1f}",
             ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["bytes_by_dtype"].items())]
            for r in rows]
    machine = common.machine_info()
    md = "\n".join([
        common.md_table(header, body), "",
        f"{args.preset}: the attention and feed-forward kernels of its {cfg.num_layers} blocks "
        f"({len(kernels)} kernels, {n:,} parameters; quantize_block={args.block}); the rest of "
        f"the model ({rest / 2**20:.1f} MiB fp32: embeddings, norms, biases) is in "
        "'whole model' and stays fp32. Bytes of the arrays quantize_params returns (shapes and "
        "dtypes from jax.eval_shape), scales and absmax leaves included"
        + ("; checked against really quantized arrays." if checked else "."), "",
        f"- bf16 / nf4: **{ratios['bf16_over_nf4']:.2f}x**; bf16 / nf4+dq: "
        f"{ratios['bf16_over_nf4dq']:.2f}x; fp32 / nf4: {ratios['fp32_over_nf4']:.2f}x; "
        f"bf16 / int8: {ratios['bf16_over_int8']:.2f}x.",
        f"- Machine: {machine['cpu']} ({machine['cpu_isa']}), jax {machine['jax']} "
        f"({machine['backend']}); sizes do not depend on it.",
    ])
    print(md, flush=True)
    return {"benchmark": "quant_bytes", "machine": machine, "preset": args.preset,
            "block": args.block, "kernels": len(kernels), "kernel_params": n,
            "other_bytes": rest, "rows": rows, "ratios": ratios,
            "checked_real_arrays": checked, "markdown": md}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="the tiny preset, quantized for real as well")
    p.add_argument("--preset", default=None, help="GPTConfig preset (default gpt2; tiny with --smoke)")
    p.add_argument("--block", type=int, default=64, help="quantize_block")
    p.add_argument("--out", type=Path, default=None,
                   help="output stem (default benchmarks/results/quant_bytes[_smoke])")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.smoke else "gpt2")
    args.out = args.out or common.RESULTS_DIR / ("quant_bytes_smoke" if args.smoke else "quant_bytes")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    js, md = common.write_results(args.out.name, result,
                                  "# Quantized parameter bytes\n\n" + result["markdown"],
                                  out_dir=args.out.parent)
    print(f"\nwrote {js} and {md}")
    return result


if __name__ == "__main__":
    main()
