"""GPT-2 124M on WikiText-103 (or LM1B) on a TPU v4-32 pod slice: 16 chips on 4 hosts, one
process per host.

Commands (from your machine; NFS_IP:/share is a file share every host mounts, e.g. a
Filestore instance in the same VPC; REPO is this repository):

    TPU=gpt2-v4-32 ZONE=us-central2-b
    gcloud compute tpus tpu-vm create $TPU --zone=$ZONE --accelerator-type=v4-32 \
        --version=tpu-ubuntu2204-base
    gcloud compute tpus tpu-vm ssh $TPU --zone=$ZONE --worker=all --command="
        sudo apt-get -y install nfs-common && sudo mkdir -p /mnt/shared &&
        sudo mount NFS_IP:/share /mnt/shared && sudo chmod a+w /mnt/shared &&
        git clone REPO transformer_jax && cd transformer_jax && python3 -m venv .venv &&
        .venv/bin/pip install -e . 'jax[tpu]'"
    gcloud compute tpus tpu-vm ssh $TPU --zone=$ZONE --worker=all --command="
        cd transformer_jax && .venv/bin/transformer-jax train --experiment gpt2_124m_tpu_v4_32 \
        --workdir /mnt/shared/runs/gpt2_124m_tpu_v4_32 --set data_dir=/mnt/shared/tfds --no-progress"

The same command runs on all 4 hosts (``--worker=all``). Each process detects the slice
(``jax.distributed`` from the TPU metadata; no flags needed), sees 16 global devices and
reads only its quarter of every batch (128 of the 512 sequences). Process 0 prepares the
tokenizer and the dataset first (the others wait, then reuse them), and alone writes
``metrics.jsonl``, TensorBoard events, samples and ``loss.png``; all four write their shards
of each orbax checkpoint. The workdir (and ``data_dir``) must be one directory every host
sees: a ``gs://`` bucket (every file of a run goes through ``transformer_jax/storage.py``;
tested against a local GCS emulator, not real GCS) or a shared file system. Stop it with Ctrl-C or
SIGTERM on all workers (they agree at the next log step, save, exit); add ``--resume`` to
continue - on this slice, on a v3-8, or on one GPU (checkpoints restore onto any mesh).

Devices: ``mesh="data=-1"``: data parallel over the 16 chips (v4 exposes one device per
chip), 32 sequences of 1024 tokens per chip; parameters and Adam state replicated. For a
bigger model, ``--mesh data=4,fsdp=4`` shards parameters and Adam state 4 ways across the
chips while the batch stays split 16 ways.

Check it first, from any machine: ``transformer-jax compile --experiment gpt2_124m_tpu_v4_32 --tpu
v4-32`` compiles the step for the 16 chips on 4 hosts (libtpu 0.0.42, jax 0.10.2): per
device 8.44 GiB of 32 (parameters 0.41, AdamW moments 0.82, temporaries 7.20).

Runtime: not measured (this machine has no TPU). Estimate: 7.71e8 training FLOP per token
(``GPTConfig.flops_per_token(1024)``) x 524,288 tokens per step = 4.04e14 FLOP per step; at
40% of 16 x 275 TFLOP/s bf16 that is 0.23 s per step, ~38 min for 10k steps (5.2B tokens,
~6 epochs of lm1b). Metric: not measured; ``eval_ppl`` is logged every 1000 steps.
Checked here: the multi-process path (``--coordinator/--num-processes/--process-id``,
per-process data shards, sharded checkpoints, resume on another mesh) runs in
``tests/test_sharding.py`` with 2 processes x 4 CPU devices.
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    """The v3-8 recipe (``gpt2_124m_tpu_v3_8``) with twice the sequence and twice the batch."""
    base = load_experiment("gpt2_124m_tpu_v3_8")
    return dataclasses.replace(
        base,
        name="gpt2_124m_tpu_v4_32",
        model_overrides={**base.model_overrides, "max_len": 1024},
        seq_len=1024,
        batch_size=512,
        steps=10_000,
        warmup_steps=700,
        log_every=50,
        eval_every=1000,
        eval_batches=32,
    )
