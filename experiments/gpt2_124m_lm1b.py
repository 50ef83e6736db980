"""GPT-2 124M on LM1B (TFDS ``lm1b``), sized for a Colab TPU (v2-8 / v3-8) or one GPU.

Command (needs a network the first time, to prepare lm1b through TFDS):

    transformer-jax train --experiment gpt2_124m_lm1b --workdir gs://BUCKET/gpt2_124m_lm1b

A SentencePiece vocabulary of 32k pieces is trained on the first 200k training sentences
into the workdir on first use. Mixed precision: bf16 compute, fp32 parameters and Adam
state; scan over layers with remat keeps compile time and memory flat in depth. No
attention dropout, so that ``attention_impl="auto"`` takes the flash kernel (Pallas on TPU,
cuDNN on a GPU); residual dropout 0.1.

Runtime: about 6-8 hours for 100k steps of 256 x 256 tokens on a TPU v3-8 (estimate from
the model FLOPs: 6.7e9 FLOP per sequence x 256 x 100k ≈ 1.7e17 FLOP at ~40% of 8 x 61.5
TFLOP/s). Metric: LM1B validation perplexity around 30-35 per SentencePiece token after
100k steps (the lm1b flax example reaches ~29 with a comparable budget); not measured here
(no TPU on the CI machine).
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="gpt2_124m_lm1b",
        model="gpt",
        model_preset="gpt2",
        model_overrides=dict(max_len=256, dtype="bfloat16", scan_layers=True, remat=True,
                             dropout_rate=0.1, attention_dropout_rate=0.0),
        dataset="lm1b",
        eval_split="test",
        tokenizer="sentencepiece",
        sentencepiece_vocab_size=32000,
        seq_len=256,
        batch_size=256,
        steps=100_000,
        schedule="warmup_rsqrt",
        learning_rate=6e-4,
        warmup_steps=2000,
        weight_decay=0.1,
        log_every=100,
        eval_every=2000,
        eval_batches=64,
        save_every=2000,
        keep=3,
        sample_prompt="The",
        sample_tokens=48,
    )
