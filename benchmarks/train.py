"""Train-step throughput and MFU: this library vs HF transformers (PyTorch eager and torch.compile).

For each case (GPT, BERT, T5 and ViT at two sizes) one random-weight HF model is built from
the HF config that ``interop.hf_config`` writes for our config (same widths, heads, vocab,
norm eps, activation; dropout 0 on both sides), and both sides train on the same batch with
AdamW (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, global-norm clip 1.0):

* ours:  ``make_train_step`` + ``make_optimizer``, jitted with the state donated;
* eager: ``loss = model(**batch).loss; loss.backward(); clip_grad_norm_; opt.step();
  opt.zero_grad()``, the HF model in train mode, fp32, torch's default threads;
* compile: the same with ``torch.compile(model)`` (the optimizer step stays eager).

The three run alternating in one process (``common.alternate``), after warm-up calls that
include our XLA compile and the torch.compile compile (both reported). tokens/s =
tokens per step / median step time; MFU = model FLOPs per step (PaLM / nanoGPT convention,
``<Config>.flops_per_token`` etc.: 6 N + 12 L D T per token) / step time / peak, the peak
being the fp32 matmul FLOP/s measured in the same run (``train.monitor.measure_matmul_peak``).
MFU is given for every implementation against the same model-FLOP count, so it is just
tokens/s on a common scale.

Also reported for our step: the jit cache size after all steps (1 = no recompilation),
whether the donated state's buffers were consumed (donation took effect), and, for the
default experiment, the data iterator's time per batch against the step time.

Usage::

    python benchmarks/train.py                      # all families, two sizes each (~7 min here)
    python benchmarks/train.py --quick              # one small size per family, compile for GPT only
    python benchmarks/train.py --families gpt --no-compile
    python benchmarks/train.py --families gpt --no-compile --loss-chunk 1024
                                                    # also our step with the chunked loss

``--loss-chunk N`` adds our step with ``make_train_step(loss_chunk=N)`` (the read-out and
cross-entropy N positions of each row at a time, ``losses.chunked_cross_entropy``) to the
alternation of the cases whose loss takes it (GPT's ``lm_loss``) and reports its median
step time over the plain step's (> 1: chunking is slower).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax.train.monitor import measure_matmul_peak  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.losses import lm_loss, token_loss  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402

OPT = dict(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, clip=1.0)


@dataclasses.dataclass
class Case:
    """One benchmark configuration: how to build both sides and how to count its work."""
    family: str
    name: str
    build: Callable[[np.random.Generator], "Built"]


@dataclasses.dataclass
class Built:
    config: Any                       # our config
    module: Any
    init_args: tuple                  # for create_train_state
    batch: dict                       # our batch (jnp arrays)
    loss_fn: Callable                 # train.step loss function
    hf_model: Any                     # torch module (train mode)
    hf_inputs: dict                   # kwargs of hf_model(...) (incl. labels)
    tokens: int                       # tokens per step
    flops: float                      # model FLOPs per step
    unit: str = "tokens"


# ----------------------------------------------------------------------------- families

def _hf():
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    return torch, transformers


def _torch_ids(x):
    torch, _ = _hf()
    return torch.as_tensor(np.asarray(x), dtype=torch.long)


def gpt_case(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int) -> Case:
    def build(rng):
        torch, transformers = _hf()
        from transformer_jax.interop import hf_config
        from transformer_jax.models import GPT, GPTConfig
        cfg = GPTConfig(vocab_size=vocab, max_len=seq, num_layers=layers, num_heads=heads,
                        d_model=width, dropout_rate=0.0, attention_dropout_rate=0.0)
        ids = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
        hf = transformers.GPT2LMHeadModel(hf_config(cfg, bos_token_id=None, eos_token_id=None))
        tokens = batch * seq
        return Built(cfg, GPT(cfg), (jnp.asarray(ids[:, :-1]),),
                     {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
                      "weights": jnp.ones((batch, seq), jnp.float32)},
                     lm_loss, hf.train(),
                     # HF shifts the labels itself: logits for all T positions, loss on T - 1
                     {"input_ids": _torch_ids(ids[:, :-1]), "labels": _torch_ids(ids[:, :-1])},
                     tokens, cfg.flops_per_token(seq) * tokens)
    return Case("gpt", f"GPT {layers}L/{width} (T={seq}, B={batch}, V={vocab})", build)


def _mlm_loss(apply_fn, params, batch, rngs, deterministic, smoothing):
    logits = apply_fn({"params": params}, batch["inputs"], None, batch["attention_mask"],
                      deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["targets"], batch["weights"], smoothing)


def bert_case(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int) -> Case:
    def build(rng):
        torch, transformers = _hf()
        from transformer_jax.interop import hf_config
        from transformer_jax.models.bert import BertConfig, BertForMaskedLM
        cfg = BertConfig(vocab_size=vocab, max_len=seq, num_layers=layers, num_heads=heads,
                         d_model=width, dropout_rate=0.0, attention_dropout_rate=0.0, head="mlm")
        ids = rng.integers(5, vocab, (batch, seq)).astype(np.int32)
        masked = rng.random((batch, seq)) < 0.15
        inputs = np.where(masked, 4, ids).astype(np.int32)        # id 4 plays [MASK]
        hf = transformers.BertForMaskedLM(hf_config(cfg))
        tokens = batch * seq
        ones = np.ones((batch, seq), np.int32)
        return Built(cfg, BertForMaskedLM(cfg), (jnp.asarray(inputs),),
                     {"inputs": jnp.asarray(inputs), "attention_mask": jnp.asarray(ones),
                      "targets": jnp.asarray(ids), "weights": jnp.asarray(masked, jnp.float32)},
                     _mlm_loss, hf.train(),
                     {"input_ids": _torch_ids(inputs), "attention_mask": _torch_ids(ones),
                      "labels": _torch_ids(np.where(masked, ids, -100))},
                     tokens, cfg.flops_per_token(seq) * tokens)
    return Case("bert", f"BERT-MLM {layers}L/{width} (T={seq}, B={batch}, V={vocab})", build)


def _seq2seq_loss(apply_fn, params, batch, rngs, deterministic, smoothing):
    logits = apply_fn({"params": params}, batch["inputs"], batch["decoder_inputs"],
                      batch["attention_mask"], deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["targets"], batch["weights"], smoothing)


def t5_case(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int) -> Case:
    def build(rng):
        torch, transformers = _hf()
        from transformer_jax.interop import hf_config
        from transformer_jax.models import T5, T5Config
        cfg = T5Config(vocab_size=vocab, d_model=width, num_heads=heads, head_dim=width // heads,
                       mlp_dim=4 * width, num_layers=layers, dropout_rate=0.0)
        src = rng.integers(2, vocab, (batch, seq)).astype(np.int32)
        tgt = rng.integers(2, vocab, (batch, seq)).astype(np.int32)
        dec_in = np.concatenate([np.full((batch, 1), cfg.decoder_start_token_id, np.int32),
                                 tgt[:, :-1]], axis=1)
        ones = np.ones((batch, seq), np.int32)
        hf = transformers.T5ForConditionalGeneration(hf_config(cfg))
        tokens = 2 * batch * seq
        return Built(cfg, T5(cfg), (jnp.asarray(src), jnp.asarray(dec_in)),
                     {"inputs": jnp.asarray(src), "decoder_inputs": jnp.asarray(dec_in),
                      "attention_mask": jnp.asarray(ones), "targets": jnp.asarray(tgt),
                      "weights": jnp.ones((batch, seq), jnp.float32)},
                     _seq2seq_loss, hf.train(),
                     {"input_ids": _torch_ids(src), "attention_mask": _torch_ids(ones),
                      "labels": _torch_ids(tgt)},
                     tokens, cfg.flops_per_example(seq, seq) * batch)
    return Case("t5", f"T5 {layers}+{layers}L/{width} (S=T={seq}, B={batch}, V={vocab})", build)


def _image_loss(apply_fn, params, batch, rngs, deterministic, smoothing):
    logits = apply_fn({"params": params}, batch["images"], deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["labels"], None, smoothing)


def vit_case(layers: int, width: int, heads: int, image: int, patch: int, batch: int,
             classes: int = 10) -> Case:
    def build(rng):
        torch, transformers = _hf()
        from transformer_jax.interop import hf_config
        from transformer_jax.models import ViT, ViTConfig
        cfg = ViTConfig(image_size=image, patch_size=patch, num_classes=classes,
                        num_layers=layers, num_heads=heads, d_model=width, mlp_dim=4 * width,
                        head_zeroinit=False)
        images = rng.standard_normal((batch, image, image, 3)).astype(np.float32)
        labels = rng.integers(0, classes, (batch,)).astype(np.int32)
        hf = transformers.ViTForImageClassification(hf_config(cfg))
        tokens = batch * cfg.seq_len
        return Built(cfg, ViT(cfg), (jnp.asarray(images),),
                     {"images": jnp.asarray(images), "labels": jnp.asarray(labels)},
                     _image_loss, hf.train(),
                     {"pixel_values": torch.from_numpy(images.transpose(0, 3, 1, 2).copy()),
                      "labels": _torch_ids(labels)},
                     tokens, cfg.flops_per_image() * batch, unit="tokens")
    return Case("vit", f"ViT {layers}L/{width} ({image}px/{patch}, B={batch})", build)


def default_cases() -> list[Case]:
    return [
        gpt_case(4, 128, 4, 128, 32, 259),          # the default experiment's model and batch
        gpt_case(6, 384, 6, 256, 8, 8192),          # the target configuration
        bert_case(4, 256, 4, 128, 16, 8192),
        bert_case(6, 384, 6, 128, 16, 8192),
        t5_case(2, 256, 4, 64, 16, 8192),
        t5_case(4, 384, 6, 64, 16, 8192),
        vit_case(6, 192, 3, 32, 4, 32),             # 65 tokens per image
        vit_case(12, 192, 3, 64, 8, 16),            # ViT-Ti/8 at 64 px: 65 tokens
    ]


def quick_cases() -> list[Case]:
    return [gpt_case(2, 128, 4, 128, 8, 259), bert_case(2, 128, 4, 64, 8, 2048),
            t5_case(1, 128, 4, 32, 8, 2048), vit_case(2, 128, 4, 32, 4, 8)]


# ----------------------------------------------------------------------------- one case

def _hf_step_fn(model_call, model, opt, inputs):
    torch, _ = _hf()

    def step():
        loss = model_call(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def our_train_step(built: Built, seed: int = 0, loss_chunk: int = 0):
    """Our side of a case with AdamW(OPT): (the jitted step, which donates its state, the
    first state, a call that runs one step on ``built.batch`` and waits for it)."""
    tx = make_optimizer(schedule=constant(OPT["lr"]), b1=OPT["b1"], b2=OPT["b2"], eps=OPT["eps"],
                        weight_decay=OPT["weight_decay"], clip_norm=OPT["clip"])
    state = create_train_state(built.module, tx, jax.random.PRNGKey(seed), *built.init_args)
    step = jax.jit(make_train_step(loss_fn=built.loss_fn, loss_chunk=loss_chunk),
                   donate_argnums=(0,))
    holder = {"state": state}

    def call():
        holder["state"], metrics = step(holder["state"], built.batch)
        jax.block_until_ready(metrics)
    return step, state, call


def hf_adamw(model):
    """torch AdamW with the settings of OPT (clipping is in ``_hf_step_fn``)."""
    torch, _ = _hf()
    return torch.optim.AdamW(model.parameters(), lr=OPT["lr"], betas=(OPT["b1"], OPT["b2"]),
                             eps=OPT["eps"], weight_decay=OPT["weight_decay"])


def run_case(case: Case, *, rounds: int, warmup: int, use_compile: bool,
             seed: int = 0, loss_chunk: int = 0) -> dict[str, Any]:
    """Time one case; ``run`` adds the MFU once the peak is known."""
    torch, _ = _hf()
    torch.manual_seed(seed)
    built = case.build(np.random.default_rng(seed))
    record: dict[str, Any] = {"family": case.family, "name": case.name,
                              "params": built.config.num_params(), "tokens_per_step": built.tokens,
                              "model_flops_per_step": built.flops}

    # ours: compile (first call) timed separately
    step, state, ours = our_train_step(built, seed)
    old_leaf = jax.tree_util.tree_leaves(state.params)[0]
    del state
    _, record["ours_compile_s"] = common.timed(ours)
    record["donated"] = bool(old_leaf.is_deleted())

    fns: dict[str, Callable[[], Any]] = {"ours": ours}
    if loss_chunk and getattr(built.loss_fn, "chunks", False):
        fns["ours_chunked"] = our_train_step(built, seed, loss_chunk)[2]
        record["loss_chunk"] = loss_chunk
    hf = built.hf_model
    opt_eager = hf_adamw(hf)
    fns["hf_eager"] = _hf_step_fn(hf, hf, opt_eager, built.hf_inputs)
    if use_compile:
        # a fresh dynamo cache per case: otherwise the cases before this one count against
        # dynamo's recompile limit (8) and torch.compile silently falls back to eager
        torch._dynamo.reset()
        compiled = torch.compile(hf)
        comp_step = _hf_step_fn(compiled, hf, opt_eager, built.hf_inputs)
        _, record["hf_compile_warmup_s"] = common.timed(lambda: (comp_step(), comp_step()))
        fns["hf_compile"] = comp_step

    times = common.alternate(fns, rounds=rounds, warmup=warmup)
    record["jit_cache_size"] = int(step._cache_size())
    for name, ts in times.items():
        t = common.median(ts)
        record[name] = {"step_s": t, "times_s": ts, "tokens_per_s": built.tokens / t}
    ours_s = record["ours"]["step_s"]
    if "ours_chunked" in record:
        record["chunked_over_plain"] = record["ours_chunked"]["step_s"] / ours_s
        record["round_chunked_over_plain"] = common.round_ratios(
            record["ours_chunked"]["times_s"], record["ours"]["times_s"])
    for peer in ("hf_eager", "hf_compile"):
        if peer in record:
            record[f"speedup_vs_{peer}"] = record[peer]["step_s"] / ours_s
            record[f"round_speedups_vs_{peer}"] = common.round_ratios(record[peer]["times_s"],
                                                               record["ours"]["times_s"])
    record["load_average"] = common.load_average()
    del ours, hf, fns
    return record


# ----------------------------------------------------------------------------- data pipeline

def data_pipeline(batches: int = 30, step_s: float = 0.005) -> dict[str, Any]:
    """The default experiment's training iterator: seconds per batch (after the first), taken
    back to back (how fast the background thread makes them), and the wait in ``next()``
    after a ``step_s`` sleep standing in for a train step (what the loop waits)."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import ExperimentConfig

    cfg = ExperimentConfig()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as workdir:
        t0 = time.perf_counter()
        task = make_task(cfg, workdir)
        it = task.train_iterator(0, 1)
        first = next(it)
        setup_s = time.perf_counter() - t0
        times, waits = [], []
        for _ in range(batches):
            t0 = time.perf_counter()
            next(it)
            times.append(time.perf_counter() - t0)
        for _ in range(batches):
            time.sleep(step_s)
            t0 = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t0)
    shapes = {k: tuple(np.shape(v)) for k, v in first.items()}
    return {"experiment": cfg.name, "batch_shapes": shapes, "setup_and_first_batch_s": setup_s,
            "batch_s_median": common.median(times), "batch_s_max": max(times),
            "wait_after_step_s_median": common.median(waits), "sleep_step_s": step_s}


# ----------------------------------------------------------------------------- report

def markdown(records: list[dict], peak: float, data: dict | None) -> str:
    header = ["case", "params", "ours ms", "HF eager ms", "torch.compile ms", "ours tok/s",
              "ours MFU", "eager MFU", "compile MFU", "ours/eager", "ours/compile",
              "ours/eager per round (quartiles)", "compile s (ours / torch)", "jit cache", "donated"]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["name"], "error: " + r["error"]] + [""] * (len(header) - 2))
            continue

        def ms(impl):
            return common.fmt(r[impl]["step_s"] * 1e3 if impl in r else None, ".0f")

        def mfu(impl):
            return common.fmt(r[impl]["mfu"] if impl in r else None, ".0%")

        def ratio(key):
            return f"{r[key]:.2f}x" if key in r else "-"

        def spread(key):
            q = r.get(key)
            return f"{q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f})" if q else "-"

        rows.append([
            r["name"], f"{r['params'] / 1e6:.2f}M", ms("ours"), ms("hf_eager"), ms("hf_compile"),
            f"{r['ours']['tokens_per_s']:,.0f}", mfu("ours"), mfu("hf_eager"), mfu("hf_compile"),
            ratio("speedup_vs_hf_eager"), ratio("speedup_vs_hf_compile"),
            spread("round_speedups_vs_hf_eager"),
            f"{r['ours_compile_s']:.1f} / {common.fmt(r.get('hf_compile_warmup_s'), '.1f')}",
            r["jit_cache_size"], "yes" if r["donated"] else "NO"])
    text = [common.md_table(header, rows), "",
            f"MFU against the fp32 matmul peak measured in this run (the larger of the "
            f"measurements before and after the cases): {peak / 1e9:.0f} GFLOP/s. "
            "ours/eager and ours/compile are ratios of the median step times (> 1: ours is "
            "faster); per round: the median and quartiles of each round's eager/ours ratio. "
            "torch.compile s = its first two steps (compile included)."]
    for r in records:
        if "chunked_over_plain" in r:
            q = r["round_chunked_over_plain"]
            text += ["", f"{r['name']}: loss_chunk={r['loss_chunk']} step "
                     f"{r['ours_chunked']['step_s'] * 1e3:.0f} ms against the plain loss's "
                     f"{r['ours']['step_s'] * 1e3:.0f} ms: chunked/plain "
                     f"{r['chunked_over_plain']:.3f} (per round {q['median']:.3f}, quartiles "
                     f"{q['q1']:.3f}-{q['q3']:.3f})"]
    if data:
        line = (f"Data pipeline ({data['experiment']}, batches {data['batch_shapes']}): "
                f"{data['batch_s_median'] * 1e3:.2f} ms per batch (max {data['batch_s_max'] * 1e3:.2f} ms)")
        if "wait_after_step_s_median" in data:
            line += (f"; next() after a {data['sleep_step_s'] * 1e3:.0f} ms step waits "
                     f"{data['wait_after_step_s_median'] * 1e3:.3f} ms (made on a thread)")
        if data.get("step_s"):
            line += (f" vs a train step of {data['step_s'] * 1e3:.0f} ms "
                     f"({data['batch_s_median'] / data['step_s']:.1%} of it)")
        text += ["", line]
    return "\n".join(text)


def run(args) -> dict[str, Any]:
    cases = quick_cases() if args.quick else default_cases()
    if args.families:
        wanted = set(args.families.split(","))
        cases = [c for c in cases if c.family in wanted]
    peak = measure_matmul_peak()
    print(f"# train: {len(cases)} cases; fp32 matmul peak {peak / 1e9:.0f} GFLOP/s", flush=True)
    records = []
    for case in cases:
        use_compile = not args.no_compile and (not args.quick or case.family == "gpt")
        try:
            r = run_case(case, rounds=args.rounds, warmup=args.warmup, use_compile=use_compile,
                         loss_chunk=args.loss_chunk)
        except Exception as e:  # noqa: BLE001 - report and keep going
            r = {"family": case.family, "name": case.name,
                 "error": f"{type(e).__name__}: {e}"[:300]}
        records.append(r)
        if "error" in r:
            print(f"  {case.name}: {r['error']}", flush=True)
        else:
            peers = [f"{k} {r[k]['step_s'] * 1e3:.0f} ms" for k in ("hf_eager", "hf_compile") if k in r]
            ratios = [f"ours/{k[3:]} {r['speedup_vs_' + k]:.2f}x"
                      for k in ("hf_eager", "hf_compile") if "speedup_vs_" + k in r]
            print(f"  {case.name}: ours {r['ours']['step_s'] * 1e3:.0f} ms, {', '.join(peers)}; "
                  f"{', '.join(ratios)}", flush=True)
    data = None
    if not args.no_data:
        data = data_pipeline()
        ref = next((r for r in records if r.get("name", "").startswith("GPT 4L/128") and "ours" in r), None)
        if ref:
            data["step_s"] = ref["ours"]["step_s"]
            data["batch_over_step"] = data["batch_s_median"] / ref["ours"]["step_s"]
        print(f"  data pipeline: {data['batch_s_median'] * 1e3:.2f} ms/batch", flush=True)
    # MFU against the larger of the peaks measured before and after: a peak measured while
    # the machine is busy would be too low and inflate every MFU.
    peak_after = measure_matmul_peak()
    peak_ref = max(peak, peak_after)
    for r in records:
        for impl in ("ours", "ours_chunked", "hf_eager", "hf_compile"):
            if impl in r:
                r[impl]["mfu"] = r["model_flops_per_step"] / r[impl]["step_s"] / peak_ref
    return {"benchmark": "train", "machine": common.machine_info(), "peak_flops": peak_ref,
            "peak_flops_before": peak, "peak_flops_after": peak_after, "optimizer": OPT,
            "rounds": args.rounds, "records": records, "data_pipeline": data,
            "markdown": markdown(records, peak_ref, data)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes, torch.compile for GPT only")
    p.add_argument("--families", default=None, help="comma-separated subset of gpt,bert,t5,vit")
    p.add_argument("--rounds", type=int, default=5, help="timed alternating rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each side first")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--no-data", action="store_true", help="skip the data-pipeline timing")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="also time our step with this loss_chunk (positions of each row "
                        "per chunk; 0: no)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    p.add_argument("--out", default="train", help="stem of the result files in benchmarks/results/")
    args = p.parse_args(argv)
    result = run(args)
    common.report(args.out, "Train step", result)
    return 0 if all("error" not in r for r in result["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
