"""QLoRA of Llama 3.1 8B on one TPU chip: Colab's v5e-1 (16 GiB HBM; also right for its v6e-1).

Compiled for the chip on a CPU host (``transformer-jax compile``, libtpu 0.0.42.1, jax
0.10.2; 60-160 s, 2.2 GB of host memory: shapes only, no weight is made), 2026-12-07,
with the NF4 matmul kernel (``layers/quant_matmul.py``: the base dequantized in VMEM):
per device 6.95 GiB of 16 (arguments 5.85: parameters 5.69, of them the NF4 projections
3.66 and the bf16 embedding and untied head 1.96, the adapters' AdamW moments 0.16;
temporaries 0.95; outputs 5.93, 5.77 of them over the donated arguments), 9.05 GiB
headroom. Roofline 1.81 s a step, compute-bound (501 GiB of HBM traffic); estimated step
3.31 s at 40% MFU (2.61e14 model FLOPs per 8,192 tokens, the frozen base at 4 per
weight); not measured. docs/tpu.md says what takes the memory, and what it was before
the kernel (11.02 GiB, memory-bound at 5.4-6.9 s).

Command (in a Colab TPU runtime, with Meta's weights as a Hugging Face directory)::

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment llama3_8b_qlora_tpu_v5e_1 \\
        --init-from /content/Llama-3.1-8B --workdir /content/drive/MyDrive/runs/llama3_8b_qlora

Check it first, from any machine (the TPU compiler runs on a CPU host; nothing is
downloaded and no weight is made, only shapes)::

    transformer-jax compile --experiment llama3_8b_qlora_tpu_v5e_1 --tpu v5e-1

Model: the ``llama-3.1-8b`` preset (vocabulary 128256, 32 layers, width 4096, 32 query and
8 key/value heads of 128, SwiGLU 14336, RoPE base 500000 with Llama 3's scaling, untied
head). Without
``--init-from`` the weights are random (what the compile check sizes); with it they are
the checkpoint's, its tokenizer with them.

Recipe (QLoRA, Dettmers et al. 2023): every attention and MLP projection of the frozen base
stored as NF4 in blocks of 64 (``lora.quantize="nf4"``, 4.5 bits a weight) and dequantized
to bf16 in each matmul; rank-16 adapters (alpha 32) on all seven projections of every
layer, the only parameters that train (AdamW, lr 2e-4, warmup + cosine); the embeddings,
head and norms stay frozen in bf16; compute in bf16; layers scanned and rematerialised
(nothing saved between layers but their inputs). 1024-token windows, 8 sequences a step
taken as 8 micro-batches of 1 (8,192 tokens per step).

Data: the fine-tuning slice of ``finetune_stdlib`` (the first 80% of the lines of the 14
``python_stdlib`` validation modules, ~360 KB of Python that the stdlib runs never trained
on), as plain next-token text in windows (this library has no prompt/completion task).
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig

#: every projection of attention and MLP
ALL_PROJECTIONS = "attn/(query|key|value|out)|mlp/(wi_0|wi_1|wo)"


def finetune_docs() -> list[str]:
    """The fine-tuning documents of ``finetune_stdlib`` (its held-in 80% of each module)."""
    from transformer_jax.train.config import load_experiment

    return list(load_experiment("finetune_stdlib").dataset)


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="llama3_8b_qlora_tpu_v5e_1",
        model="gpt",
        model_preset="llama-3.1-8b",
        # vocab_size: the compile check tokenizes bytes; the model keeps Llama 3's 128256 rows
        model_overrides=dict(vocab_size=128256, dtype="bfloat16", param_dtype="bfloat16",
                             scan_layers=True, remat=True,
                             lora=dict(rank=16, alpha=32, targets=ALL_PROJECTIONS,
                                       quantize="nf4")),
        dataset=finetune_docs(),
        seq_len=1024,
        batch_size=8,
        accum_steps=8,
        steps=100,
        schedule="warmup_cosine",
        learning_rate=2e-4,
        warmup_steps=10,
        weight_decay=0.0,
        clip_norm=1.0,
        parallelism="jit",
        mesh=None,
        log_every=5,
        eval_every=50,
        eval_batches=4,
        save_every=50,
        keep=1,
        sample_prompt="def ",
        sample_tokens=48,
    )
