"""Benchmark KV-cache greedy decoding of a GPT-2 (124M) model: ``decode.generate`` vs HF.

One random-weight ``GPT2LMHeadModel`` (the "gpt2" shape: 12 layers, width 768, vocab
50257) is built in PyTorch and converted with ``interop.from_hf``, so both sides run the
same fp32 weights. For each batch size, a random prompt of ``--prompt-len`` tokens is
extended by ``--new-tokens`` greedy tokens:

* ours: ``transformer_jax.decode.generate`` (one jitted program: prefill + a
  ``lax.while_loop`` over a fixed-size KV cache);
* HF:   ``GPT2LMHeadModel.generate(do_sample=False, num_beams=1)`` under
  ``torch.no_grad()``, model in eval mode, fp32, torch's default thread count.

Timing: one warmup call each (ours compiles there; its compile time is reported as the
warmup time minus the median run time), then ``--repeats`` timed runs, alternating
ours / HF so that machine noise hits both alike. tokens/s = batch * new tokens / median
wall time of the whole ``generate`` call (prefill included). The greedy tokens of both are
compared token for token; random weights are scaled up a little (``--logit-scale``) so
that the top-2 logits of a step are rarely within fp32 rounding of each other.

Results: a table on stdout and ``benchmarks/results/decode_gpt2.json``.

Usage::

    python benchmarks/decode_gpt2.py            # batch 1 and 16, 32 + 128 tokens, 3 repeats
    python benchmarks/decode_gpt2.py --quick    # 32 + 32 tokens, 1 repeat
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from transformer_jax.decode import generate  # noqa: E402
from transformer_jax.interop import from_hf  # noqa: E402


def build_hf_model(seed: int, logit_scale: float) -> transformers.GPT2LMHeadModel:
    """A random GPT-2 124M in eval mode; the tied embedding is scaled by ``logit_scale``."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)  # never stop early
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(logit_scale)
    return model


def run_ours(module, params, prompt: np.ndarray, new_tokens: int) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    out = generate(module, params, prompt, max_new_tokens=new_tokens)
    out = np.asarray(jax.block_until_ready(out))
    return out, time.perf_counter() - start


def run_hf(model, prompt: np.ndarray, new_tokens: int) -> tuple[np.ndarray, float]:
    ids = torch.as_tensor(prompt, dtype=torch.long)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=1, max_new_tokens=new_tokens, pad_token_id=0)
    return out.numpy(), time.perf_counter() - start


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


def bench_batch(module, params, model, batch: int, args, rng) -> dict:
    prompt = rng.integers(0, model.config.vocab_size, (batch, args.prompt_len)).astype(np.int32)
    n_tokens = batch * args.new_tokens
    ours_out, ours_first = run_ours(module, params, prompt, args.new_tokens)   # compiles
    hf_out, hf_first = run_hf(model, prompt, args.new_tokens)
    ours_times, hf_times = [], []
    for _ in range(args.repeats):
        ours_times.append(run_ours(module, params, prompt, args.new_tokens)[1])
        hf_times.append(run_hf(model, prompt, args.new_tokens)[1])
    ours_s, hf_s = statistics.median(ours_times), statistics.median(hf_times)
    return {
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "ours_tokens_per_s": n_tokens / ours_s,
        "hf_tokens_per_s": n_tokens / hf_s,
        "ratio_ours_over_hf": hf_s / ours_s,
        "ours_median_s": ours_s,
        "hf_median_s": hf_s,
        "ours_times_s": ours_times,
        "hf_times_s": hf_times,
        "ours_compile_s": max(ours_first - ours_s, 0.0),
        "hf_warmup_s": hf_first,
        "tokens": compare_tokens(ours_out, hf_out, args.prompt_len),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logit-scale", type=float, default=4.0,
                        help="multiply the random tied embedding by this (see the docstring)")
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "benchmarks" / "results" / "decode_gpt2.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 32, 1
    batches = [int(b) for b in args.batches.split(",")]

    model = build_hf_model(args.seed, args.logit_scale)
    start = time.perf_counter()
    module, params = from_hf(model)
    convert_s = time.perf_counter() - start
    print(f"GPT-2 124M ({sum(p.numel() for p in model.parameters()):,} params), converted in "
          f"{convert_s:.1f} s; jax {jax.__version__} on {jax.default_backend()}, torch "
          f"{torch.__version__} with {torch.get_num_threads()} threads, transformers "
          f"{transformers.__version__}")
    print(f"prompt {args.prompt_len} tokens + {args.new_tokens} greedy tokens, "
          f"median of {args.repeats} alternating runs\n")

    rng = np.random.default_rng(args.seed)
    rows = []
    for batch in batches:
        rows.append(bench_batch(module, params, model, batch, args, rng))

    header = (f"| {'batch':>5} | {'ours tok/s':>10} | {'HF tok/s':>9} | {'ours/HF':>7} | "
              f"{'ours compile s':>14} | {'HF warmup s':>11} | {'tokens identical':>16} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.strip("|").split("|")) + "|")
    for r in rows:
        ident = "yes" if r["tokens"]["identical"] else f"NO {r['tokens']}"
        print(f"| {r['batch']:>5} | {r['ours_tokens_per_s']:>10.1f} | {r['hf_tokens_per_s']:>9.1f} | "
              f"{r['ratio_ours_over_hf']:>7.2f} | {r['ours_compile_s']:>14.2f} | "
              f"{r['hf_warmup_s']:>11.2f} | {ident:>16} |")

    result = {
        "benchmark": "decode_gpt2",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": "gpt2 (124M shape, random weights)",
        "logit_scale": args.logit_scale,
        "convert_s": convert_s,
        "platform": {"machine": platform.machine(), "python": platform.python_version(),
                     "cpu_count": os.cpu_count(), "jax": jax.__version__,
                     "jax_backend": jax.default_backend(), "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads(),
                     "transformers": transformers.__version__,
                     "load_average_1_5_15min_at_end": os.getloadavg()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if all(r["tokens"]["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
