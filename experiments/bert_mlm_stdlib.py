"""Masked-LM pretraining of a small byte-level BERT on the embedded Python-stdlib corpus.

Command:

    transformer-jax train --experiment bert_mlm_stdlib --workdir runs/bert_mlm

Data: ``python_stdlib`` (133 train / 14 held-out validation modules), packed into rows of
126 bytes framed as ``[CLS] ... [SEP]`` (seq_len 128); byte ids 3..258 plus [CLS] 259,
[SEP] 260, [MASK] 261 (vocabulary 262). Masking: BERT's recipe -- 15% of the non-special
tokens of each row, of which 80% -> [MASK], 10% -> a random byte, 10% unchanged
(``tasks/mlm.py``). Model: BERT (post-norm, learned positions, GELU), 4 layers, width 128,
4 heads, MLM head tied to the word embeddings (860,550 parameters), no dropout.
Optimiser: AdamW (0.9, 0.98), warmup 50 + cosine to 1e-3 peak, clip 1.0.

Runtime here: 1,242 s (20.7 min) for 600 steps of 32 x 128 tokens, measured on this 2-core
machine while it was shared with other jobs (load average ~8; median 2.0k tokens/s, peaks of
4.0k); the same-sized GPT does ~14k tokens/s on the idle machine, so expect a few minutes
there. ``--steps`` and ``--set batch_size=...`` scale it.

Metric (measured 2026-11-29): on the held-out modules, MLM cross-entropy per masked byte
(ln 262 = 5.57 nats for a uniform guess) 2.87 at step 200 -> 2.81 at step 600 (16 eval
batches, 9.7k masked bytes; 2.77 over 100 batches = 61k masked bytes), masked-byte accuracy
35.1% (36.0%). For scale: a unigram byte model scores 3.11 nats / 29.4% there, and the 10%
of targets left unchanged can simply be copied, so after 600 steps the model predicts
mostly from byte frequencies, the bag of bytes around it and the visible token -- the long
initial plateau of MLM pretraining (only 15% of positions give a loss; learned absolute
positions must first learn to attend to neighbours). Hugging Face's PyTorch ``BertForMaskedLM``
with the same optimiser stays on the same plateau (within 0.01 nats after step 50) on a
synthetic neighbour-copy task. Samples in
``samples.txt`` show the fill-ins (at step 600 mostly spaces and frequent letters). Even so, this
encoder initialises ``bert_classify_stdlib`` measurably better than a random one (see there).
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="bert_mlm_stdlib",
        task="mlm",
        model="bert",
        model_preset="tiny",
        model_overrides=dict(num_layers=4, d_model=128, num_heads=4, max_len=128,
                             dropout_rate=0.0, attention_dropout_rate=0.0),
        seq_len=128,
        batch_size=32,
        steps=600,
        learning_rate=1e-3,
        warmup_steps=50,
        eval_every=200,
        eval_batches=16,
        save_every=200,
        sample_tokens=64,
    )
