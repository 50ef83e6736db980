"""GPT-2 124M on WikiText-103 (or LM1B) on one TPU chip: Colab's v5e-1 (also right for its v6e-1).

Command (in a Colab TPU runtime; Google Drive keeps the run across disconnects):

    pip install -e ".[tpu]"                          # in a clone of this repository
    from google.colab import drive; drive.mount("/content/drive")
    transformer-jax train --experiment gpt2_124m_tpu_v5e_1 \\
        --workdir /content/drive/MyDrive/runs/gpt2_124m_tpu_v5e_1 --no-progress
    # after a disconnect, the same command plus --resume continues at the exact batch

Check it first, from any machine (the TPU compiler runs on a CPU host):

    transformer-jax compile --experiment gpt2_124m_tpu_v5e_1 --tpu v5e-1

Data: WikiText-103 through Hugging Face ``datasets``
(``hf:Salesforce/wikitext:wikitext-103-raw-v1``), which Colab's TPU runtime (no
TensorFlow) downloads and reads as is; TFDS ``lm1b`` needs TensorFlow to prepare, so there
it is refused in one line unless its prepared folder is copied into ``data_dir``
(docs/datasets.md).

Recipe: the v3-8 recipe (``gpt2_124m_tpu_v3_8``: WikiText-103, 32k SentencePiece vocabulary, bf16
compute, fp32 parameters and AdamW moments, scanned and rematerialised layers, dropout
on the residual stream only) with 1024-token windows and a batch of 64 sequences (65,536
tokens per step) in one micro-batch, which one 16 GiB chip holds with the chunked loss
(with the plain loss it took 2 micro-batches of 32).
Attention: JAX's splash kernel (``"auto"`` on v4 and later).

The loss reads out 128 positions of each row at a time (``loss_chunk=128``: (64, 128,
32000) float32 logits, 0.98 GiB, instead of the batch's whole 7.8 GiB and their gradient).

Compiled for the chip on a CPU host (``transformer-jax compile``, libtpu 0.0.42.1, jax
0.10.2): per device 6.91 GiB of 16 with splash (7.12 GiB with our Pallas kernel: parameters
0.41, AdamW moments 0.82, temporaries 5.89).
Before the chunked loss (2 micro-batches of 32, plain loss): 9.31 GiB (temporaries 8.08);
the chunked loss with those 2 micro-batches: 5.48 GiB (temporaries 4.24).

Runtime: not measured (no TPU here). Estimate: 7.71e8 training FLOP per token
(``GPTConfig.flops_per_token(1024)``) x 65,536 tokens = 5.05e13 FLOP per step; at 40% of
the v5e's 197 TFLOP/s bf16 that is 641 ms per step, ~3.6 h for 20k steps
(1.3B tokens, ~1.5 epochs of lm1b); a v6e-1 (918 TFLOP/s) ~138 ms per step. Metric:
not measured; ``eval_ppl`` is logged every 2000 steps.
"""
import dataclasses

from transformer_jax.train.config import ExperimentConfig, load_experiment


def get_config() -> ExperimentConfig:
    base = load_experiment("gpt2_124m_tpu_v3_8")
    return dataclasses.replace(
        base,
        name="gpt2_124m_tpu_v5e_1",
        model_overrides={**base.model_overrides, "max_len": 1024},
        seq_len=1024,
        batch_size=64,
        accum_steps=1,
        loss_chunk=128,
        mesh=None,
    )
