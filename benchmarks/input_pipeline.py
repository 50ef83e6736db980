"""Input pipeline throughput against what each TPU experiment's chips consume.

Measured here, by worker count (``--workers``, default 0,1,2; 0 = in this process):

* images/s: ImageNet-like JPEGs (500x375 from smooth random content plus noise, quality
  90, ~100 KB each, so decoding costs what a photo's does: :func:`make_jpegs`) decoded,
  resized to 224, padded-cropped and flipped exactly as ``vit_b16_*`` trains (an
  ``ImageIterator`` with ``workers``);
* tokens/s: the Python standard library's own source files through the byte tokenizer
  and a SentencePiece model (vocabulary 8192) trained here, documents split across
  ``workers`` processes; and the LM stream-mode iterator (read, SentencePiece, pack) in
  this process, as training runs it.

Per-core rates count CPU seconds (user + system of this process and its workers, from
``/proc``), not wall seconds, so that other jobs on the cores do not lower them: the image
rate at the largest worker count (it pays for the hand-off to the parent), and the stream
iterator's token rate (it runs on one core of the training process: a GPT experiment is
fed if 1.5x its demand fits that core). They extrapolate linearly: the workers share
nothing but the parent's hand-off.

Then, for each TPU experiment (``experiments/*tpu*.py``): the examples/s one host's chips
consume at 40% and 60% MFU (the library's FLOPs per example, ``task.flops_per_step``; the
chips' bf16 peak from ``transformer_jax.tpu.GENERATIONS``), and the host cores ``GOAL``
(1.5) x that needs at the per-core rate, against the vCPUs of the host it runs on.

Usage::

    python benchmarks/input_pipeline.py                 # ~2 min on 2 cores
    python benchmarks/input_pipeline.py --workers 0,1,2,4 --images 192

Writes ``benchmarks/results/input_pipeline.{json,md}``; docs/performance.md carries the table.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

import numpy as np  # noqa: E402

GOAL = 1.5                  # input rate wanted, as a multiple of what the chips consume
MFUS = (0.4, 0.6)
#: (experiment, TPU type) as in benchmarks/tpu_table.py
ROWS = [("vit_b16_tpu_v5e_1", "v5e-1"), ("vit_b16_tpu_v5e_1", "v6e-1"),
        ("vit_b16_tpu_v3_8", "v3-8"), ("vit_b16_tpu_v4_32", "v4-32"),
        ("gpt2_124m_tpu_v5e_1", "v5e-1"), ("gpt2_124m_tpu_v5e_1", "v6e-1"),
        ("gpt2_124m_tpu_v5e_8", "v5e-8"), ("gpt2_124m_tpu_v3_8", "v3-8"),
        ("gpt2_124m_tpu_v4_32", "v4-32")]
#: TPU type -> (vCPUs of one of its hosts, the machine)
HOSTS = {"v5e-1": (24, "Colab v5e-1"), "v6e-1": (44, "Colab v6e-1"),
         "v5e-8": (224, "Kaggle v5e-8, assumed"), "v3-8": (96, "Cloud v3-8 TPU VM"),
         "v4-32": (240, "Cloud v4 host, 1 of 4")}
HOST_NOTES = (
    "Kaggle v5e-8: assumed 224 vCPUs, those of Cloud's ct5lp-hightpu-8t (the host of a "
    "v5litepod-8); Kaggle publishes no count, and Colab's v5e-1 has the 24 of a "
    "ct5lp-hightpu-1t. A v4-32 is 4 hosts of 4 chips and 240 vCPUs; each feeds its own chips.")


# ----------------------------------------------------------------------------- images

def make_jpegs(n: int, width: int = 500, height: int = 375, quality: int = 90,
               seed: int = 0) -> list[bytes]:
    """``n`` JPEGs of smooth random shapes (bicubic upsampled 1/8-size noise) plus pixel
    noise (sigma 14): ~100 KB at 500x375 (ImageNet's mean file: ~110 KB), so decoding
    costs what a photo's does."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        low = rng.uniform(0, 255, (max(1, height // 8), max(1, width // 8), 3))
        smooth = Image.fromarray(low.astype(np.uint8)).resize((width, height), Image.BICUBIC)
        pixels = np.asarray(smooth, np.float32) + rng.normal(0, 14, (height, width, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG",
                                                                         quality=quality)
        out.append(buf.getvalue())
    return out


class JpegSource:
    """Random-access ``{"image", "label"}`` examples decoded from JPEG bytes on access (as a
    TFDS ``data_source`` decodes)."""

    def __init__(self, jpegs: list[bytes]):
        self.jpegs = jpegs

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(self.jpegs[i])).convert("RGB"))
        return {"image": image, "label": i % 1000}


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) this process and the processes ``pids`` have used."""
    tick, total = os.sysconf("SC_CLK_TCK"), time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick     # utime, stime
    return total


def measure_images(jpegs: list[bytes], workers: int, *, image_size: int = 224,
                   batch_size: int = 32, batches: int = 6) -> tuple[float, float]:
    """(images per wall second, images per CPU second of this process and its workers) of
    augmented training batches, after 4 untimed batches (the pool started and 3 batches in
    flight: the steady state). CPU seconds do not count the time other jobs take the cores,
    so they give the per-core rate on a loaded machine."""
    from transformer_jax.data.images import ImageIterator

    it = ImageIterator(JpegSource(jpegs), name="jpegs", split="train", image_size=image_size,
                       num_channels=3, max_value=255.0, batch_size=batch_size, seed=0,
                       shuffle=True, repeat=True, augment=True, flip=True, workers=workers)
    try:
        for _ in range(4):
            next(it)
        pids = list(it._pool._executor._processes) if workers else []
        start, cpu = time.perf_counter(), _cpu_seconds(pids)
        for _ in range(batches):
            next(it)
        n = batches * batch_size
        return n / (time.perf_counter() - start), n / (_cpu_seconds(pids) - cpu)
    finally:
        it.close()


# ----------------------------------------------------------------------------- text

def stdlib_texts(max_chars: int) -> list[str]:
    """Source files of this Python's standard library, up to ``max_chars`` in all."""
    root, texts, total = Path(os.__file__).parent, [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[:max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


_TOKENIZER = {}


def _load_tokenizer(spec: str) -> None:
    from transformer_jax.data.tokenizers import get_tokenizer
    _TOKENIZER["t"] = get_tokenizer(spec)


def _count_tokens(texts: list[str]) -> int:
    return sum(len(ids) for ids in _TOKENIZER["t"].encode_batch(texts))


def measure_tokens(spec: str, texts: list[str], workers: int, rounds: int = 2) -> float:
    """Tokens/s of ``spec`` over ``texts``: in this process, or split across ``workers``
    processes (started, tokenizer loaded and one pass made before timing)."""
    chunks = [texts[i::max(1, 4 * workers)] for i in range(max(1, 4 * workers))]
    if workers == 0:
        _load_tokenizer(spec)
        _count_tokens(texts)
        start = time.perf_counter()
        tokens = sum(_count_tokens(texts) for _ in range(rounds))
        return tokens / (time.perf_counter() - start)
    from transformer_jax.data.image_workers import worker_context

    with cf.ProcessPoolExecutor(workers, mp_context=worker_context(), initializer=_load_tokenizer,
                                initargs=(spec,)) as pool:
        list(pool.map(_count_tokens, chunks))
        start = time.perf_counter()
        tokens = sum(sum(pool.map(_count_tokens, chunks)) for _ in range(rounds))
        return tokens / (time.perf_counter() - start)


def measure_stream(spec: str, texts: list[str], *, seq_len: int = 1024,
                   batch_size: int = 8, packing: str = "concatenate") -> tuple[float, float]:
    """(tokens per wall second, per CPU second) of the LM stream-mode iterator (read,
    tokenize, pack; in this process, as training runs it) over one pass of ``texts``,
    building the iterator included; ``packing="document"`` adds segment ids and positions."""
    from transformer_jax.data.pipeline import make_lm_iterator
    from transformer_jax.data.tokenizers import get_tokenizer

    total = sum(len(ids) + 1 for ids in get_tokenizer(spec).encode_batch(texts))
    batches = max(1, total // (seq_len * batch_size))
    start, cpu = time.perf_counter(), time.process_time()
    it = make_lm_iterator(texts, "train", tokenizer=spec, seq_len=seq_len,
                          batch_size=batch_size, seed=0, mode="stream", packing=packing)
    for _ in range(batches):
        next(it)
    n = batches * batch_size * seq_len
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


# ----------------------------------------------------------------------------- TPU demand

def experiment_flops(name: str) -> tuple[float, str]:
    """(training FLOPs per example, "image" or "token") of an experiment, from its task."""
    from transformer_jax.aot import _planned_task
    from transformer_jax.run import build
    from transformer_jax.train.config import load_experiment

    cfg = load_experiment(name)
    with tempfile.TemporaryDirectory() as workdir:
        task, overrides = _planned_task(cfg, workdir)
        model_cfg, _ = build(cfg, overrides)
        per_step = task.flops_per_step(model_cfg)
    if hasattr(model_cfg, "flops_per_image"):
        return per_step / cfg.batch_size, "image"
    return per_step / task.tokens_per_step(), "token"


def demand_rows(flops: dict[str, tuple[float, str]], per_core: dict[str, float],
                rows=ROWS, hosts=HOSTS) -> list[dict]:
    """For each (experiment, TPU type): what one host's chips consume at each MFU and the
    host cores ``GOAL`` x that needs at ``per_core[unit]`` (images: "image", tokens:
    "token")."""
    from transformer_jax.tpu import TpuSlice

    out = []
    for experiment, tpu_type in rows:
        per_example, unit = flops[experiment]
        tpu = TpuSlice.parse(tpu_type)
        host_flops = tpu.devices * tpu.peak_bf16 / tpu.hosts
        consumed = {mfu: host_flops * mfu / per_example for mfu in MFUS}
        cores = {mfu: GOAL * c / per_core[unit] for mfu, c in consumed.items()}
        host_cores, host = hosts[tpu_type]
        out.append({"experiment": experiment, "tpu": tpu_type, "unit": unit,
                    "flops_per_example": per_example, "chips_per_host": tpu.chips // tpu.hosts,
                    "consumed_per_s": consumed, "per_core_per_s": per_core[unit],
                    "cores_needed": cores, "host_cores": host_cores, "host": host,
                    "reaches": {mfu: c <= host_cores for mfu, c in cores.items()}})
    return out


def _verdict(row: dict) -> str:
    need = row["cores_needed"][MFUS[-1]]
    if row["unit"] == "token":   # the stream iterator tokenizes on one core
        return ("yes, on the one core stream mode uses" if need <= 1 else
                "no: stream mode tokenizes on one core; memory mode (tokenized once) or "
                "tokenizing in workers would")
    if need <= row["host_cores"]:
        return "yes"
    return (f"no: needs {need / row['host_cores']:.1f}x the cores; store the images "
            "pre-resized (shorter side 256: ~3x cheaper decode) or decode on the chip")


def render(result: dict) -> str:
    m = result["measured"]
    rates = [[f"{w}", f"{m['images_per_s'][w]:.0f}", f"{m['images_per_cpu_s'][w]:.0f}",
              f"{m['tokens_per_s']['byte'][w] / 1e3:.0f}k",
              f"{m['tokens_per_s']['sentencepiece'][w] / 1e3:.0f}k"] for w in m["workers"]]
    size = result["data"]["image_size"]
    table1 = common.md_table(["workers", f"images/s ({size} px, augmented)",
                              "images per CPU s", "byte tokens/s",
                              "SentencePiece tokens/s"], rates)
    rows = []
    for r in result["rows"]:
        c, n = r["consumed_per_s"], r["cores_needed"]
        rows.append([f"`{r['experiment']}`", r["tpu"], f"{r['flops_per_example']:.3g}",
                     " / ".join(f"{c[mfu]:,.0f}" for mfu in MFUS) + f" {r['unit']}s/s",
                     f"{r['per_core_per_s']:,.0f}",
                     " / ".join(f"{n[mfu]:.1f}" for mfu in MFUS),
                     f"{r['host_cores']} ({r['host']})", _verdict(r)])
    table2 = common.md_table(
        ["experiment", "TPU", "FLOPs / example", "one host's chips consume (40% / 60% MFU)",
         "per core /s", f"cores for {GOAL}x (40% / 60%)", "host vCPUs", "reached"], rows)
    return f"{table1}\n\n{table2}\n\n{HOST_NOTES}"


def run(args) -> dict:
    workers = [int(w) for w in args.workers.split(",")]
    jpegs = make_jpegs(args.images, args.width, args.height)
    texts = stdlib_texts(args.text_chars)
    images_per_s, images_per_cpu_s, tokens = {}, {}, {"byte": {}, "sentencepiece": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from transformer_jax.data.tokenizers import train_sentencepiece
        spm = Path(tmp) / "spm.model"
        train_sentencepiece(texts, args.vocab, spm)
        specs = {"byte": "byte", "sentencepiece": f"sentencepiece:{spm}"}
        specs_stream = specs["sentencepiece"]
        for w in workers:
            images_per_s[w], images_per_cpu_s[w] = measure_images(
                jpegs, w, image_size=args.image_size, batch_size=args.batch,
                batches=args.batches)
            for name, spec in specs.items():
                tokens[name][w] = measure_tokens(spec, texts, w)
            print(f"workers {w}: {images_per_s[w]:.0f} images/s "
                  f"({images_per_cpu_s[w]:.0f} per CPU s), "
                  f"{tokens['byte'][w]:.0f} byte / {tokens['sentencepiece'][w]:.0f} "
                  f"SentencePiece tokens/s", flush=True)
        stream, stream_cpu = measure_stream(specs_stream, texts, seq_len=args.seq_len)
        print(f"stream mode, SentencePiece: {stream:.0f} tokens/s ({stream_cpu:.0f} per CPU s)",
              flush=True)
    top = max(workers)
    per_core = {"image": images_per_cpu_s[top], "token": stream_cpu}
    names = sorted({e for e, _ in args.rows})
    flops = args.flops or {name: experiment_flops(name) for name in names}
    result = {"machine": {"cpu": common.cpu_model(), "cpu_isa": common.cpu_isa(),
                          "cpu_count": os.cpu_count(), "load_average_1_5_15min":
                          common.load_average(), "python": platform.python_version()},
              "data": {"jpeg_mean_bytes": float(np.mean([len(j) for j in jpegs])),
                       "jpeg_size": [args.width, args.height],
                       "image_size": args.image_size, "batch": args.batch,
                       "text_chars": args.text_chars},
              "measured": {"workers": workers, "images_per_s": images_per_s,
                           "images_per_cpu_s": images_per_cpu_s,
                           "tokens_per_s": tokens,
                           "stream_sentencepiece_tokens_per_s": stream,
                           "stream_sentencepiece_tokens_per_cpu_s": stream_cpu},
              "per_core_per_s": per_core, "goal": GOAL,
              "rows": demand_rows(flops, per_core, args.rows)}
    result["markdown"] = render(result)
    return result


def run_packing(args) -> dict:
    """Only the LM stream iterator, byte and SentencePiece, ``packing`` "concatenate" (the
    default) against "document" (segment ids and positions): tokens per CPU second, best
    of ``args.rounds`` passes (``--packing``)."""
    texts = stdlib_texts(args.text_chars)
    out = {"machine": {"cpu": common.cpu_model(), "cpu_count": os.cpu_count(),
                       "load_average_1_5_15min": common.load_average()},
           "text_chars": args.text_chars, "seq_len": args.seq_len, "tokens_per_cpu_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from transformer_jax.data.tokenizers import train_sentencepiece
        spm = Path(tmp) / "spm.model"
        train_sentencepiece(texts, args.vocab, spm)
        for name, spec in (("byte", "byte"), ("sentencepiece", f"sentencepiece:{spm}")):
            for packing in ("concatenate", "document"):
                rate = max(measure_stream(spec, texts, seq_len=args.seq_len, packing=packing)[1]
                           for _ in range(args.rounds))
                out["tokens_per_cpu_s"][f"{name}/{packing}"] = rate
                print(f"stream mode, {name}, packing={packing}: {rate:,.0f} tokens per CPU s",
                      flush=True)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--text-chars", type=int, default=2_000_000)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "input_pipeline")
    p.add_argument("--packing", action="store_true", help="only the LM stream iterator, "
                   "packing=concatenate vs packing=document")
    p.add_argument("--rounds", type=int, default=3, help="--packing: passes per rate (best)")
    args = p.parse_args(argv)
    args.rows, args.flops = ROWS, None
    return args


def main(argv=None, **overrides) -> dict:
    """Runs and writes ``--out``.{json,md}; ``overrides`` replace parsed arguments (tests:
    ``rows``, ``flops``)."""
    args = parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    if args.packing:
        result = run_packing(args)
        print(result)
        return result
    result = run(args)
    machine = result["machine"]
    header = (f"# Input pipeline\n\nCPU: {machine['cpu']} ({machine['cpu_isa']}), load "
              f"{machine['load_average_1_5_15min']}\n\n")
    js, md = common.write_results(args.out.name, result, header + result["markdown"],
                                  out_dir=args.out.parent)
    print("\n" + result["markdown"] + f"\n\nwrote {js} and {md}")
    return result


if __name__ == "__main__":
    main()
