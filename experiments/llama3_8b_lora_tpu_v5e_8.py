"""LoRA of Llama 3.1 8B on Kaggle's v5e-8 (8 chips of 16 GiB), the bf16 base split by FSDP.

Compiled for the slice on a CPU host (``transformer-jax compile``, libtpu 0.0.42.1, jax
0.10.2; 183-220 s, 2.2 GB of host memory: shapes only): per chip 4.71 GiB of 16 (arguments
2.03: parameters 1.92, the adapters' AdamW moments 0.11; temporaries 2.57; outputs 2.09,
1.98 of them over the donated arguments). The 16.1 GB bf16 base is split 8 ways; the
collectives per step as the report counts them: all-gather x5382 (580,076 MiB), all-reduce
x66 (104 MiB), all-to-all x3, collective-permute x7363 (docs/tpu.md: the all-gather
volume is far above the 3 gathers of the weights per micro-batch one expects; not yet
explained).
Estimated step 2.5 s at 40% MFU (1.58e15 model FLOPs per 32,768 tokens); not measured.

Command (in a Kaggle TPU v5e-8 notebook, Meta's weights as a Hugging Face directory)::

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment llama3_8b_lora_tpu_v5e_8 \\
        --init-from /kaggle/input/llama-3.1-8b --workdir /kaggle/working/runs/llama3_8b_lora
    # then score it on the same chips (docs/lm_eval_harness.md):
    transformer-jax eval --workdir /kaggle/working/runs/llama3_8b_lora \\
        --tasks hellaswag,arc_easy --dtype bfloat16 --mesh fsdp=-1

Check it first, from any machine (only shapes; the TPU compiler runs on a CPU host)::

    transformer-jax compile --experiment llama3_8b_lora_tpu_v5e_8 --tpu v5e-8

Recipe: ``llama3_8b_qlora_tpu_v5e_1``'s (Llama 3.1 8B's shapes, rank-16 adapters on every
attention and MLP projection, AdamW lr 2e-4, bf16 compute, scanned and rematerialised
layers, the same data) with the frozen base in bf16 instead of NF4, every weight split
along its embed axis over the 8 chips (``mesh="fsdp=-1"``: XLA gathers each layer's
weights where it is used), 2048-token windows and 16 sequences a step (2 micro-batches of
8, one sequence a chip; 32,768 tokens per step).
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    base = load_experiment("llama3_8b_qlora_tpu_v5e_1")
    lora = {k: v for k, v in base.model_overrides["lora"].items() if k != "quantize"}
    return dataclasses.replace(
        base,
        name="llama3_8b_lora_tpu_v5e_8",
        model_overrides={**base.model_overrides, "lora": lora},
        seq_len=2048,
        batch_size=16,
        accum_steps=2,
        mesh="fsdp=-1",
    )
