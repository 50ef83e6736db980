"""Full fine-tuning of Llama 3.2 1B on one TPU chip: Colab's v5e-1 (16 GiB HBM; also its v6e-1).

Compiled for the chip on a CPU host (``transformer-jax compile``, libtpu 0.0.42.1, jax
0.10.2; 92 s, 1.7 GB of host memory): per device 14.78 GiB of 16 (arguments 6.91:
parameters 2.30, AdamW moments 4.60; temporaries 3.27; outputs 9.21, 4.60 of them over the
donated arguments), 1.22 GiB headroom. Micro-batches of 2 would add another row's float32
logits (1 GiB) and their softmax: keep 1 on a v5e-1. Estimated step 3.42 s at 40% MFU
(2.69e14 model FLOPs per 32,768 tokens); not measured.

Command (in a Colab TPU runtime, Meta's weights as a Hugging Face directory)::

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment llama3_2_1b_finetune_tpu_v5e_1 \\
        --init-from /content/Llama-3.2-1B --workdir /content/drive/MyDrive/runs/llama3_2_1b_ft

Check it first, from any machine (only shapes; the TPU compiler runs on a CPU host)::

    transformer-jax compile --experiment llama3_2_1b_finetune_tpu_v5e_1 --tpu v5e-1

Recipe: every parameter trains (AdamW, lr 2e-5, warmup + cosine, weight decay 0.1),
parameters and AdamW moments in bf16 (float32 ones with their moments need 16 bytes a
parameter: 19.8 GB for these 1.24B, more than the chip), compute in bf16, layers scanned
and rematerialised, 2048-token windows, 16 sequences a step as 16 micro-batches of 1
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
        # vocab_size: the compile check tokenizes bytes; the model keeps Llama 3's 128256 rows
        model_overrides=dict(vocab_size=128256, dtype="bfloat16", param_dtype="bfloat16",
                             scan_layers=True, remat=True),
        seq_len=2048,
        batch_size=16,
        accum_steps=16,
        learning_rate=2e-5,
        weight_decay=0.1,
    )
