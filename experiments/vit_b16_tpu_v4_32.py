"""ViT-B/16 on ImageNet-2012 from scratch on a TPU v4-32 pod slice (16 chips, 4 hosts).

Commands (from your machine; as in ``gpt2_124m_tpu_v4_32``: create the slice, mount one
file share at /mnt/shared on every worker, clone and install; ImageNet prepared for TFDS
once under /mnt/shared/tfds - see ``vit_b16_tpu_v3_8`` - so every host reads it):

    gcloud compute tpus tpu-vm ssh $TPU --zone=$ZONE --worker=all --command="
        cd transformer_jax && .venv/bin/transformer-jax train --experiment vit_b16_tpu_v4_32 \\
        --workdir /mnt/shared/runs/vit_b16_tpu_v4_32 --set data_dir=/mnt/shared/tfds --no-progress"

All 4 hosts run the same command; ``jax.distributed`` is initialised from the TPU
metadata, each process loads 1024 of the 4096 images of every batch (its 4 chips' rows),
process 0 alone writes logs and plots, all write the sharded checkpoints. Elsewhere, a
multi-process launch takes ``--coordinator HOST:PORT --num-processes N --process-id I``
(or SLURM's ``srun``, detected).

Recipe: the ViT paper's ImageNet-1k training scaled as published - batch 4096 (256 per
chip), Adam (0.9, 0.999), 10k warmup steps then cosine from 3e-3, clip 1.0, dropout 0.1 -
with decoupled weight decay 0.1 and label smoothing 0.1; 300 epochs (93.75k steps); bf16
compute, fp32 parameters and moments; random crops and flips. For reference, DeiT quotes
77.9% top-1 for the ViT paper's ImageNet-only B/16 (fine-tuned at 384).

Devices: ``mesh="data=-1"``: data parallel over the 16 chips. ``--mesh data=4,fsdp=4``
shards parameters and AdamW state 4 ways (for ViT-L/H); ``--resume`` continues on any
mesh or slice.

Check it first, from any machine: ``transformer-jax compile --experiment vit_b16_tpu_v4_32 --tpu
v4-32`` compiles the step for the 16 chips on 4 hosts (libtpu 0.0.42, jax 0.10.2): per
device 7.15 GiB of 32 (parameters 0.32, AdamW moments 0.64, temporaries 6.03).

Runtime: not measured (this machine has no TPU). Estimate: 1.055e11 training FLOP per
image x 4096 = 4.3e14 FLOP per step; at 40% of 16 x 275 TFLOP/s that is 0.25 s per step,
~6.4 h for 300 epochs. Each host decodes and augments its 1024 images per step in one
worker process per core (``data_workers``): 1.5x its 4 chips at 40% MFU needs ~33 of its
240 vCPUs at the per-core rate of docs/performance.md (2026-12-07).
Metric: not measured; ``eval_accuracy`` is logged every 5000 steps.
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    """The v3-8 recipe (``vit_b16_tpu_v3_8``) with a 4x batch, the ViT paper's peak learning
    rate and weight decay for batch 4096, and a longer warmup."""
    return dataclasses.replace(
        load_experiment("vit_b16_tpu_v3_8"),
        name="vit_b16_tpu_v4_32",
        batch_size=4096,
        steps=93_750,
        learning_rate=3e-3,
        warmup_steps=10_000,
        weight_decay=0.1,
        eval_batches=13,
    )
