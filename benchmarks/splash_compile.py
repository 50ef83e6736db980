"""JAX's splash kernel compiled for every TPU generation, head dim and length.

The real TPU compiler (libtpu, on this host; no TPU needed) compiles forward + backward of
``dot_product_attention`` with ``attention_impl="auto"`` (splash on v4 and later), bf16,
causal, one sequence of 8 query heads on 2 kv heads, under a one-device mesh of the TPU
type's devices, at the block sizes of ``splash_attention.SPLASH_BLOCKS``. Each cell is
whether Mosaic and XLA:TPU compile it, the compile seconds and the temporaries the compiler
reserves; these are compiles, not timings on a chip.

Usage::

    python benchmarks/splash_compile.py          # 4 x 3 x 3 compiles (~10 min, 2 busy cores)
    python benchmarks/splash_compile.py --tpu v5e-1 --lengths 512,8192 --segments

Writes ``benchmarks/results/splash_compile.{json,md}``; docs/tpu.md carries the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

TPUS = ("v4-8", "v5e-1", "v5p-8", "v6e-1")
HEAD_DIMS = (64, 128, 256)
LENGTHS = (512, 2048, 8192)


def compile_one(tpu: str, head_dim: int, t: int, segments: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from transformer_jax.layers import dot_product_attention
    from transformer_jax.tpu import TpuSlice

    mesh = jax.make_mesh((1,), ("x",), devices=TpuSlice.parse(tpu).jax_devices()[:1])
    q = jax.ShapeDtypeStruct((1, t, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 2, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32) if segments else None

    def loss(q, k, v, ids):
        out = dot_product_attention(q, k, v, causal=True, segment_ids=ids)
        return jnp.sum(out.astype(jnp.float32))

    start = time.perf_counter()
    row = dict(tpu=tpu, head_dim=head_dim, t=t, segments=segments)
    try:
        with jax.set_mesh(mesh):
            lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, ids).lower(
                lowering_platforms=("tpu",))
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a compile failure is a result
        return {**row, "compiled": False, "error": str(e).splitlines()[0][:300],
                "seconds": time.perf_counter() - start}
    mem = compiled.memory_analysis()
    text = lowered.as_text()
    return {**row, "compiled": True, "seconds": time.perf_counter() - start,
            "mosaic_calls": text.count("tpu_custom_call"), "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes}


def render(rows: list[dict]) -> str:
    table = []
    for r in rows:
        if r["compiled"]:
            cell = [f"yes ({r['mosaic_calls']} Mosaic calls)", f"{r['seconds']:.1f}",
                    f"{r['temp_bytes'] / 2**20:.1f}"]
        else:
            cell = [f"**no**: {r['error'][:120]}", f"{r['seconds']:.1f}", "-"]
        table.append([r["tpu"], r["head_dim"], r["t"], *cell])
    return common.md_table(["TPU", "H", "T", "compiles", "compile s", "temporaries MiB"],
                           table)


def run(tpus, head_dims, lengths, segments: bool) -> dict:
    import jax
    import libtpu

    from transformer_jax.layers.splash_attention import SPLASH_BLOCKS, tpu_name
    rows = []
    for tpu in tpus:
        for h in head_dims:
            for t in lengths:
                r = compile_one(tpu, h, t, segments)
                print(f"{tpu} H={h} T={t}: {'ok' if r['compiled'] else 'FAILED'} "
                      f"({r['seconds']:.1f} s)", flush=True)
                rows.append(r)
    blocks = {tpu: SPLASH_BLOCKS[tpu_name(jax_kind(tpu))].__dict__ for tpu in tpus}
    return {"machine": common.machine_info(), "jax": jax.__version__,
            "libtpu": libtpu.__version__, "blocks": blocks, "rows": rows,
            "markdown": render(rows)}


def jax_kind(tpu: str) -> str:
    from transformer_jax.tpu import TpuSlice
    return TpuSlice.parse(tpu).jax_devices()[0].device_kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tpu", default=",".join(TPUS), help="TPU types, comma-separated")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--segments", action="store_true", help="with segment ids (packed documents)")
    args = p.parse_args(argv)
    result = run(args.tpu.split(","), [int(x) for x in args.head_dims.split(",")],
                 [int(x) for x in args.lengths.split(",")], args.segments)
    common.report("splash_compile", "The splash kernel compiled for TPU generations", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
