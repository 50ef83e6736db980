"""Scaling laws of a byte-level GPT: eval loss against model size, compute and data.

Commands::

    transformer-jax sweep --experiment scaling_laws --workdir runs/scaling --quick
    transformer-jax sweep --experiment scaling_laws --workdir runs/scaling_full   # a TPU or GPU
    # another text corpus for the full grid (its data members need 100M training tokens),
    # e.g. lm1b where TensorFlow is installed to prepare it:
    transformer-jax sweep --experiment scaling_laws --workdir runs/scaling_lm1b \\
        --set dataset=lm1b --set eval_split=test

Started again with the same command, a sweep continues where it stopped (finished members
are skipped, the running one resumes from its checkpoint).

The grid (``get_sweep``): GPTs with learned positions, GELU MLPs of 4 D, and heads of width
32 (one head below width 64):

* **size** members: 7 shapes (layers x width) spanning 2.4 decades of non-embedding
  parameters N, each trained for the same tokens. Fit: L(N) = E + A N^-alpha on the final
  eval loss.
* **data** members: one shape trained on the first D tokens of the training split
  (``task.train_tokens``; nested subsets, 2 decades of D) for the same steps, so the small
  subsets are seen many times. Fit: L(D) = E + B D^-beta on the best eval loss (early
  stopping).
* **compute**: every eval of every member is a point (C = tokens so far x FLOPs per token,
  6 (N + V D) + 12 L D T); the frontier is the lowest loss reached with at most C FLOPs.
  Fit: L(C) = E + B C^-gamma; the members owning the frontier give N_opt ∝ C^n.

The learning rate warms up, then decays as 1/sqrt(step) (``warmup_rsqrt``), a schedule
that does not depend on the run's length: each eval of a run is then exactly the final
loss of a shorter run, which the compute frontier reads it as.

Quick mode (``--quick``): ``python_stdlib`` (bytes, ~4.4M training tokens), T = 128, 32
rows a step, 300 steps (1.23M tokens) per member, an eval of 8 batches every 25 steps;
N from 3.3k to 0.79M; data members of width 96 x 3 layers on 10k to 1M tokens.

Full mode: WikiText-103 (``hf:Salesforce/wikitext:wikitext-103-raw-v1``, read by Hugging
Face ``datasets``: downloaded once into ``$HF_HOME``, needs a network, no TensorFlow, so it
runs on Colab's TPU runtime; eval on its ``validation`` split), bytes, T = 256, 256 rows a
step (65,536 tokens), 2,000 steps (131M tokens) per member, peak learning rate 1e-3,
bfloat16; N from 0.1M to 25M; data members of width 256 x 4 layers on 1M to 100M tokens.
About 5.5e16 training FLOPs in all: sized for about an hour on a Colab TPU v2-8 or v3-8 (an
estimate from the FLOPs at 30% of the chips' bfloat16 peak; not measured). TFDS ``lm1b``
stays selectable where TensorFlow prepares it (``--set dataset=lm1b --set eval_split=test``,
the commands above); without TensorFlow it is refused in one line (docs/datasets.md).

Output in the sweep's workdir: ``results.jsonl`` (a row per member), ``fit.json``,
``scaling.png`` (three log-log panels) and ``scaling.md`` (the exponents beside Kaplan et
al. 2020's and Chinchilla's).

Runtime here (2 CPU cores, AMD EPYC Zen 4): ``--quick`` 9 min 16 s for the 13 members and
the analysis (2026-12-02). Results (nats per byte; ``scaling.md``; docs/scaling_laws.md has
every member)::

  law        exponent [90% interval]   E     r²     log-log slope   Kaplan  Chinchilla
  L(N)       alpha_N 0.058 [0.045, 0.125]  0.46  0.995  0.047           0.076   0.34
  L(C)       gamma_C 0.188 [0.104, 0.270]  1.77  0.983  0.056           0.050   -
  L(D)       beta_D  0.372 [0.133, 0.605]  2.15  0.982  0.054           0.095   0.28
  N_opt(C)   1.13                                                       0.73    0.50

The final eval loss falls from 2.871 (3.3k parameters) to 2.214 (0.79M); the data model's
best eval loss from 2.938 (10k bytes, at step 50: it overfits) to 2.321 (1M bytes).
docs/scaling_laws.md says why these differ from Kaplan's and Chinchilla's.
"""
from __future__ import annotations

from transformer_jax.train.config import ExperimentConfig

#: (layers, width) of the size members
QUICK_SIZES = ((1, 16), (1, 32), (2, 32), (2, 48), (2, 64), (3, 96), (4, 128))
FULL_SIZES = ((2, 64), (2, 128), (4, 128), (4, 256), (6, 256), (6, 384), (8, 512))
#: the data members: their (layers, width) and their nested training subsets (tokens)
QUICK_DATA_MODEL, QUICK_DATA = (3, 96), (10_000, 25_000, 60_000, 150_000, 400_000, 1_000_000)
FULL_DATA_MODEL, FULL_DATA = (4, 256), (1_000_000, 3_000_000, 10_000_000, 30_000_000,
                                        100_000_000)
#: the full grid's corpus (TF-free: Colab's TPU runtime reads it) and its eval split
FULL_DATASET, FULL_EVAL_SPLIT = "hf:Salesforce/wikitext:wikitext-103-raw-v1", "validation"
#: what the full grid changes in every member (a sweep's --set still overrides it)
FULL = {"dataset": FULL_DATASET, "eval_split": FULL_EVAL_SPLIT, "seq_len": 256, "batch_size": 256,
        "steps": 2000, "warmup_steps": 100, "eval_every": 100, "eval_batches": 16,
        "save_every": 500, "learning_rate": 1e-3, "model.max_len": 256,
        "model.dtype": "bfloat16"}


def get_config() -> ExperimentConfig:
    """What every member shares (the quick grid's settings); members set their shape."""
    return ExperimentConfig(
        name="scaling_laws", dataset="python_stdlib", tokenizer="byte",
        seq_len=128, batch_size=32, steps=300, schedule="warmup_rsqrt", warmup_steps=30,
        learning_rate=3e-3, eval_every=25, eval_batches=8, save_every=100, sample_tokens=0,
        model_overrides=dict(num_layers=2, d_model=64, num_heads=2, max_len=128,
                             dropout_rate=0.0, attention_dropout_rate=0.0))


def _shape(layers: int, width: int) -> dict:
    return {"model.num_layers": layers, "model.d_model": width, "model.num_heads": max(1, width // 32)}


def get_sweep(quick: bool) -> list[dict]:
    """The size members, then the data members (see the module docstring)."""
    sizes, data_model, data = ((QUICK_SIZES, QUICK_DATA_MODEL, QUICK_DATA) if quick else
                               (FULL_SIZES, FULL_DATA_MODEL, FULL_DATA))
    common = {} if quick else FULL
    members = [{"name": f"size-L{layers}-D{width}", "group": "size",
                "set": {**common, **_shape(layers, width)}} for layers, width in sizes]
    members += [{"name": f"data-{tokens}", "group": "data",
                 "set": {**common, **_shape(*data_model), "task.train_tokens": tokens}}
                for tokens in data]
    return members


def analyze(workdir, rows, quick):
    """fit.json, scaling.png and scaling.md in the workdir (``transformer_jax.scaling``)."""
    from transformer_jax import scaling

    return scaling.analyze(rows, workdir, title="quick grid" if quick else "full grid")
