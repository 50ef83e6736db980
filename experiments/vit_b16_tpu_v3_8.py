"""ViT-B/16 on ImageNet-2012 from scratch, data parallel over a TPU v3-8 (or v2-8).

Colab retired its v2-8 in September 2025; on its single chips use ``vit_b16_tpu_v5e_1``.
On a v3-8 / v2-8 (ImageNet must be prepared for TFDS first: download
ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar into ``DATA/downloads/manual`` and let
TFDS build ``imagenet2012`` there - it cannot download ImageNet itself):

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment vit_b16_tpu_v3_8 --set data_dir=DATA \\
        --workdir /content/drive/MyDrive/runs/vit_b16_tpu_v3_8 --no-progress
    # after a disconnect: the same command plus --resume

Check it first, from any machine: ``transformer-jax compile --experiment vit_b16_tpu_v3_8
--tpu v3-8``. Compiled on a CPU host (libtpu 0.0.42, jax 0.10.2): per device 4.82 GiB of 16 (parameters 0.32, AdamW moments 0.64, temporaries 3.78);
v2-8: 4.82 GiB of 8. Attention: XLA's on v2/v3 (no Pallas kernels there), the flash kernel
on v4 and later.

Recipe: ViT-B/16 (86.6M parameters, 224x224 images, 197 tokens), bf16 compute with fp32
parameters and AdamW moments, layers scanned and rematerialised; batch 1024 (128 per
core), AdamW (0.9, 0.999, weight decay 0.05), 5 warmup epochs then cosine from 1e-3
(DeiT's lr 5e-4 x 1024/512), clip 1.0, label smoothing 0.1, dropout 0.1; 90 epochs
(112.5k steps); random crops and flips (``task.augment``). No RandAugment/Mixup (the task
has none), so expect less than DeiT's 81.8% (trained 300 epochs with them).

Devices: ``mesh="data=-1"``: the 8 cores on ``data``, parameters and AdamW state
replicated (86.6M x 12 bytes = 1.0 GB per core); ``--mesh fsdp=8`` shards them 8 ways
(0.13 GB per core) for bigger ViTs on the 8 GB cores of a v2-8. Checkpoints restore onto
any mesh, e.g. continue on a v4-32 with ``--resume``.

Runtime: not measured (this machine has no TPU). Estimate: 1.055e11 training FLOP per
image (``ViTConfig.flops_per_image()``) x 1024 = 1.08e14 FLOP per step; at 40% of the
v3-8's 8 x 61.5 TFLOP/s that is 0.55 s per step, ~17 h for 90 epochs (a v2-8: ~47 h), in
several Colab sessions. Images are decoded and augmented in one worker process per host
core (``data_workers``): 1.5x the v3-8 at 40% MFU needs ~15 of its host's 96 vCPUs at the
per-core rate of docs/performance.md (2026-12-07). Metric: not measured; ``eval_accuracy``
(top-1 on the 50k validation images) is logged every 5000 steps.
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="vit_b16_tpu_v3_8",
        task="image_classification",
        task_options=dict(augment=True),
        model="vit",
        model_preset="B/16",
        model_overrides=dict(dtype="bfloat16", scan_layers=True, remat=True, dropout_rate=0.1),
        dataset="imagenet2012",
        eval_split="validation",
        batch_size=1024,
        steps=112_500,
        schedule="warmup_cosine",
        learning_rate=1e-3,
        warmup_steps=6_250,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.05,
        clip_norm=1.0,
        label_smoothing=0.1,
        parallelism="jit",
        mesh="data=-1",
        log_every=100,
        eval_every=5000,
        eval_batches=49,
        save_every=2500,
        keep=3,
    )
