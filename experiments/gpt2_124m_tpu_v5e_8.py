"""GPT-2 124M on WikiText-103 (or LM1B) on the 8 chips of a Kaggle TPU v5e-8 (one host).

Command (in a Kaggle notebook with the TPU v5e-8 accelerator; /kaggle/working keeps
the run for the session, save it as a dataset version to keep it longer):

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment gpt2_124m_tpu_v5e_8 \\
        --workdir /kaggle/working/runs/gpt2_124m_tpu_v5e_8 --no-progress
    # the same command plus --resume continues from the last checkpoint

Check it first, from any machine: ``transformer-jax compile --experiment
gpt2_124m_tpu_v5e_8 --tpu v5e-8``.

Recipe: the v3-8 recipe (``gpt2_124m_tpu_v3_8``) with 1024-token windows and a batch of
256 sequences (262,144 tokens per step), 32 per chip; ``mesh="data=-1"``: data parallel,
parameters and AdamW state replicated. Attention: the Pallas (Mosaic) flash kernel.

Compiled for the slice on a CPU host (``transformer-jax compile``, libtpu 0.0.42, jax
0.10.2): per device 8.44 GiB of 16 (parameters 0.41, AdamW moments 0.82, temporaries 7.20).

Runtime: not measured (no TPU here). Estimate: 7.71e8 training FLOP per token x 262,144
tokens = 2.02e14 FLOP per step; at 40% of 8 x 197 TFLOP/s bf16 that is 321 ms per step,
~0.9 h for 10k steps (2.6B tokens, ~3 epochs of lm1b). Metric: not measured;
``eval_ppl`` is logged every 1000 steps.
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    base = load_experiment("gpt2_124m_tpu_v3_8")
    return dataclasses.replace(
        base,
        name="gpt2_124m_tpu_v5e_8",
        model_overrides={**base.model_overrides, "max_len": 1024},
        seq_len=1024,
        batch_size=256,
        steps=10_000,
        warmup_steps=700,
        eval_every=1000,
        eval_batches=32,
    )
