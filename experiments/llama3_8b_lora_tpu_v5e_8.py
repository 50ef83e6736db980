"""LoRA of Llama 3.1 8B on Kaggle's v5e-8 (8 chips of 16 GiB), the bf16 base split by FSDP.

FIGURES

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
