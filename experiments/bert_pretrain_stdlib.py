"""BERT pretraining (masked LM + next-sentence prediction) of a small byte-level BERT on
the embedded Python-stdlib corpus.

Command:

    transformer-jax train --experiment bert_pretrain_stdlib --workdir runs/bert_pretrain

Data: ``python_stdlib`` (133 train / 14 held-out validation modules). Each module's lines
are packed into chunks of at most 62 bytes (half of 128 - 3); a pair is ``[CLS] A [SEP] B
[SEP]`` with B the chunk after A (IsNext) or, half of the time, a chunk of another module
(NotNext): 79,557 train and 8,611 held-out pairs per pass (``tasks/pretrain.py``). Then
BERT's masking, 15% of the bytes, 80/10/10. Vocabulary: bytes + [CLS] [SEP] [MASK] (262).
Model: BERT (post-norm, learned positions, GELU), 2 layers, width 128, 4 heads, MLM head
tied to the word embeddings, pooler + NSP head (480,776 parameters), no dropout.
Optimiser: AdamW (0.9, 0.98), warmup 50 + cosine to 1e-3 peak, clip 1.0.

Runtime here: 564 s (9.4 min) for 1,200 steps of 32 pairs x 128 tokens, measured on this
2-core AMD EPYC machine while it was shared with other jobs (load average ~3; median 9.3k
tokens/s, peaks of 16k). ``--steps`` and ``--set batch_size=...`` scale it.

Metric (measured 2026-12-03), on the held-out modules, the whole split (8,611 pairs:
``transformer-jax eval --workdir runs/bert_pretrain --batches 300``): NSP accuracy 57.9%
(chance 50%; one standard error 0.54 points), NSP cross-entropy 0.665 nats (ln 2 = 0.693);
masked-byte accuracy 39.2%, MLM cross-entropy 2.35 nats per masked byte. The logged evals
(64 batches, 2,048 pairs) read NSP 53.3% / 54.6% / 57.1% at steps 400 / 800 / 1,200, and
the training NSP loss stays at ln 2 until about step 700: NSP here is a second-order
question (does B's indentation, style, vocabulary fit A's?), which a small model starts to
answer only after MLM has shaped its features. For scale, one hand-written rule (IsNext when
B's first line is indented as A's last line allows) scores 67.6% on these pairs; a
4-layer model (the MLM experiment's) was still at chance after 400 steps (9.6 min).

Continue pretraining an HF BERT (``BertForPreTraining.save_pretrained`` directory, its
tokenizer included): add ``--init-from DIR``; the model, its MLM and NSP heads and the
tokenizer are the checkpoint's.
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="bert_pretrain_stdlib",
        task="pretrain",
        model="bert",
        model_preset="tiny",
        model_overrides=dict(num_layers=2, d_model=128, num_heads=4, max_len=128,
                             dropout_rate=0.0, attention_dropout_rate=0.0),
        seq_len=128,
        batch_size=32,
        steps=1200,
        learning_rate=1e-3,
        warmup_steps=50,
        eval_every=400,
        eval_batches=64,
        save_every=400,
        sample_tokens=64,
    )
