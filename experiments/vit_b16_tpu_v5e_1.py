"""ViT-B/16 on ImageNet-2012 from scratch on one TPU chip: Colab's v5e-1 (also a v6e-1).

Command (in a Colab TPU runtime; ImageNet must be prepared for TFDS first, as in
``vit_b16_tpu_v3_8``):

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment vit_b16_tpu_v5e_1 --set data_dir=DATA \\
        --workdir /content/drive/MyDrive/runs/vit_b16_tpu_v5e_1 --no-progress
    # after a disconnect: the same command plus --resume

Check it first, from any machine: ``transformer-jax compile --experiment vit_b16_tpu_v5e_1
--tpu v5e-1``.

Recipe: the v3-8 recipe (``vit_b16_tpu_v3_8``: batch 1024, AdamW, 90 epochs, label
smoothing, crops and flips) with the batch taken as 8 micro-batches of 128 images
(``accum_steps=8``): the same optimisation, on one chip. Attention: the Pallas (Mosaic)
flash kernel (197 tokens, no attention dropout).

Compiled for the chip on a CPU host (``transformer-jax compile``, libtpu 0.0.42, jax
0.10.2): per device 6.38 GiB of 16 (parameters 0.32, AdamW moments 0.64, temporaries 4.84); v6e-1: 6.38 GiB of 32.

Runtime: not measured (no TPU here). Estimate: 1.055e11 training FLOP per image
(``ViTConfig.flops_per_image()``) x 1024 = 1.08e14 FLOP per step; at 40% of the v5e's 197
TFLOP/s that is 1371 ms per step, ~43 h for 90 epochs (112.5k steps), many
Colab sessions; a v6e-1 ~294 ms per step. Images are decoded and augmented in one worker
process per host core (``data_workers``): at the per-core rate measured on 2026-12-07
(docs/performance.md) 1.5x the v5e-1 at 40% MFU needs 6 of its host's 24 vCPUs, a v6e-1
28 of 44 (42 at 60% MFU: tight). Metric: not measured.
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    base = load_experiment("vit_b16_tpu_v3_8")
    return dataclasses.replace(base, name="vit_b16_tpu_v5e_1", accum_steps=8, mesh=None)
