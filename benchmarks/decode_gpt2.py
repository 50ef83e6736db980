"""KV-cache greedy decoding of GPT-2 (124M): ``decode.generate`` vs HF ``generate``, and the roofline.

One random-weight ``GPT2LMHeadModel`` (the "gpt2" shape: 12 layers, width 768, vocab
50257) is built in PyTorch and converted with ``interop.from_hf``, so both sides run the
same fp32 weights. For each batch size, a random prompt of ``--prompt-len`` tokens is
extended by ``--new-tokens`` greedy tokens:

* ours: ``transformer_jax.decode.generate`` (one jitted program: prefill + a
  ``lax.while_loop`` over a fixed-size KV cache);
* HF:   ``GPT2LMHeadModel.generate(do_sample=False, num_beams=1)`` under
  ``torch.no_grad()``, model in eval mode, fp32, torch's default thread count.

Timing: one warm-up call each (ours compiles there; its compile time is the warm-up time
minus the median run time), then ``--repeats`` rounds alternating ours / HF in this
process. tokens/s = batch * new tokens / median wall time of the whole ``generate`` call
(prefill included). The greedy tokens of both are asserted identical token for token;
random weights are scaled up a little (``--logit-scale``) so that the top-2 logits of a
step are rarely within fp32 rounding of each other. The jit cache of ``generate`` is
checked not to grow over the repeats (no recompilation per call or per token).

Memory roofline: decoding one token per sequence reads every weight once and the KV cache
filled so far, so a step needs at least ``bytes = parameter bytes + KV bytes`` (KV bytes =
2 * layers * batch * mean filled length * width * 4) of memory traffic. The bandwidth is
measured in the same run (``common.measure_memory_bandwidth``: the faster of a 256 MiB copy
and a 256 MiB matrix-vector read), and "roofline share" = achieved tokens/s /
(batch * bandwidth / bytes).

Results: a table on stdout and ``benchmarks/results/decode_gpt2.{json,md}``.

Usage::

    python benchmarks/decode_gpt2.py            # batch 1 and 16, 32 + 128 tokens, 3 repeats (~3 min)
    python benchmarks/decode_gpt2.py --quick    # 32 + 32 tokens, 1 repeat
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax import decode  # noqa: E402
from transformer_jax.interop import from_hf  # noqa: E402


def build_hf_model(seed: int, logit_scale: float):
    """A random GPT-2 124M in eval mode; the tied embedding is scaled by ``logit_scale``."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)  # never stop early
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(logit_scale)
    return model


def run_ours(module, params, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    out = decode.generate(module, params, prompt, max_new_tokens=new_tokens)
    return np.asarray(jax.block_until_ready(out))


def run_hf(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    import torch
    ids = torch.as_tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=1, max_new_tokens=new_tokens, pad_token_id=0)
    return out.numpy()


def compare_tokens(ours: np.ndarray, theirs: np.ndarray, prompt_len: int) -> dict:
    """Whether the generated tokens agree, and where they first differ if not."""
    if ours.shape != theirs.shape:
        return {"identical": False, "detail": f"shapes differ: ours {ours.shape}, HF {theirs.shape}"}
    diff = np.argwhere(ours[:, prompt_len:] != theirs[:, prompt_len:])
    if diff.size == 0:
        return {"identical": True}
    row, step = (int(v) for v in diff[0])
    return {"identical": False, "first_difference": {"row": row, "step": step},
            "rows_differing": int(len(np.unique(diff[:, 0])))}


def step_bytes(cfg, params, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Bytes one decode step must read at least: all parameters + the mean filled KV cache."""
    param_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    mean_len = prompt_len + (new_tokens - 1) / 2
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    kv_bytes = 2 * cfg.num_layers * batch * mean_len * kv_heads * cfg.head_dim * 4
    return {"param_bytes": param_bytes, "kv_bytes": kv_bytes, "bytes": param_bytes + kv_bytes}


def bench_batch(module, params, model, batch: int, args, rng, bandwidth: float) -> dict:
    prompt = rng.integers(0, model.config.vocab_size, (batch, args.prompt_len)).astype(np.int32)
    n_tokens = batch * args.new_tokens
    outs: dict[str, np.ndarray] = {}

    def ours():
        outs["ours"] = run_ours(module, params, prompt, args.new_tokens)

    def hf():
        outs["hf"] = run_hf(model, prompt, args.new_tokens)

    _, ours_first = common.timed(ours)            # compiles
    _, hf_first = common.timed(hf)
    cache_before = decode.jitted_generate._cache_size()
    times = common.alternate({"ours": ours, "hf": hf}, rounds=args.repeats, warmup=0)
    recompiled = decode.jitted_generate._cache_size() != cache_before
    ours_s, hf_s = common.median(times["ours"]), common.median(times["hf"])
    need = step_bytes(module.config, params, batch, args.prompt_len, args.new_tokens)
    roofline_tps = batch * bandwidth / need["bytes"]
    return {
        "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "ours_tokens_per_s": n_tokens / ours_s, "hf_tokens_per_s": n_tokens / hf_s,
        "ratio_ours_over_hf": hf_s / ours_s,
        "ours_median_s": ours_s, "hf_median_s": hf_s,
        "ours_times_s": times["ours"], "hf_times_s": times["hf"],
        "ours_compile_s": max(ours_first - ours_s, 0.0), "hf_warmup_s": hf_first,
        "recompiled_during_repeats": recompiled,
        **need, "roofline_tokens_per_s": roofline_tps,
        "ours_roofline_share": n_tokens / ours_s / roofline_tps,
        "hf_roofline_share": n_tokens / hf_s / roofline_tps,
        "tokens": compare_tokens(outs["ours"], outs["hf"], args.prompt_len),
        "load_average": common.load_average(),
    }


def markdown(rows: list[dict], bandwidth: dict[str, float]) -> str:
    header = ["batch", "ours tok/s", "HF tok/s", "ours/HF", "roofline tok/s", "ours share",
              "HF share", "ours compile s", "recompiled", "tokens identical"]
    body = []
    for r in rows:
        body.append([r["batch"], f"{r['ours_tokens_per_s']:.1f}", f"{r['hf_tokens_per_s']:.1f}",
                     f"{r['ratio_ours_over_hf']:.2f}x", f"{r['roofline_tokens_per_s']:.0f}",
                     f"{r['ours_roofline_share']:.0%}", f"{r['hf_roofline_share']:.0%}",
                     f"{r['ours_compile_s']:.1f}", "NO" if not r["recompiled_during_repeats"] else "YES",
                     "yes" if r["tokens"]["identical"] else f"NO {r['tokens']}"])
    r0 = rows[0]
    return (common.md_table(header, body) + "\n\n"
            f"GPT-2 124M fp32, prompt {r0['prompt_len']} + {r0['new_tokens']} greedy tokens. "
            f"Roofline: measured memory bandwidth {bandwidth['roofline'] / 1e9:.1f} GB/s (copy "
            f"{bandwidth['copy'] / 1e9:.1f}, matrix-vector read {bandwidth['read'] / 1e9:.1f}); "
            f"bytes per step = "
            f"parameters ({r0['param_bytes'] / 2**20:.0f} MiB) + KV cache at the mean filled length.")


def run(args) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    model = build_hf_model(args.seed, args.logit_scale)
    module, params = from_hf(model)
    bandwidth = common.measure_memory_bandwidth()
    print(f"# decode: GPT-2 124M, batches {batches}, {args.prompt_len} + {args.new_tokens} tokens, "
          f"{args.repeats} alternating repeats; memory bandwidth {bandwidth['roofline'] / 1e9:.1f} GB/s "
          f"(copy {bandwidth['copy'] / 1e9:.1f}, read {bandwidth['read'] / 1e9:.1f})", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for batch in batches:
        r = bench_batch(module, params, model, batch, args, rng, bandwidth["roofline"])
        rows.append(r)
        print(f"  batch {batch}: ours {r['ours_tokens_per_s']:.1f} tok/s, HF {r['hf_tokens_per_s']:.1f} "
              f"tok/s, ours/HF {r['ratio_ours_over_hf']:.2f}x, identical={r['tokens']['identical']}",
              flush=True)
    return {"benchmark": "decode_gpt2", "machine": common.machine_info(),
            "model": "gpt2 (124M shape, random weights)", "logit_scale": args.logit_scale,
            "bandwidth_bytes_per_s": bandwidth["roofline"], "bandwidth_streams": bandwidth,
            "args": vars(args), "rows": rows,
            "markdown": markdown(rows, bandwidth)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-scale", type=float, default=4.0,
                   help="multiply the random tied embedding by this (see the docstring)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat")
    add_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 32, 1
    result = run(args)
    common.report("decode_gpt2", "Decode", result)
    return 0 if all(r["tokens"]["identical"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
