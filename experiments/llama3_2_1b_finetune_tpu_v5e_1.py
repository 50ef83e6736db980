"""Full fine-tuning of Llama 3.2 1B on one TPU chip: Colab's v5e-1 (16 GiB HBM; also its v6e-1).

FIGURES

Command (in a Colab TPU runtime, Meta's weights as a Hugging Face directory)::

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment llama3_2_1b_finetune_tpu_v5e_1 \\
        --init-from /content/Llama-3.2-1B --workdir /content/drive/MyDrive/runs/llama3_2_1b_ft

Check it first, from any machine (only shapes; the TPU compiler runs on a CPU host)::

    transformer-jax compile --experiment llama3_2_1b_finetune_tpu_v5e_1 --tpu v5e-1

Recipe: every parameter trains (AdamW, lr 2e-5, warmup + cosine, weight decay 0.1),
parameters and AdamW moments in bf16 (float32 ones with their moments need 16 bytes a
parameter: 19.8 GB for these 1.24B, more than the chip), compute in bf16, layers scanned
and rematerialised, 2048-token windows, 16 sequences a step as 8 micro-batches of 2
(32,768 tokens per step). Data: ``llama3_8b_qlora_tpu_v5e_1``'s (``finetune_stdlib``'s
fine-tuning slice of the stdlib validation modules, as plain text windows).
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    base = load_experiment("llama3_8b_qlora_tpu_v5e_1")
    return dataclasses.replace(
        base,
        name="llama3_2_1b_finetune_tpu_v5e_1",
        model_preset="llama-3.2-1b",
        model_overrides=dict(dtype="bfloat16", param_dtype="bfloat16", scan_layers=True,
                             remat=True),
        seq_len=2048,
        batch_size=16,
        accum_steps=8,
        learning_rate=2e-5,
        weight_decay=0.1,
    )
