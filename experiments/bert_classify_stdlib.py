"""Fine-tune a small byte-level BERT to tell code, comment and string (docstring) lines apart.

Commands (from scratch, then initialised from the MLM run of ``bert_mlm_stdlib``):

    transformer-jax train --experiment bert_classify_stdlib --workdir runs/bert_classify
    transformer-jax train --experiment bert_mlm_stdlib --workdir runs/bert_mlm
    transformer-jax train --experiment bert_classify_stdlib --workdir runs/bert_classify_pt \\
        --set task.pretrained=runs/bert_mlm

Data: ``python_stdlib`` line roles (``tasks/classify.py``): every non-blank line of every
module, labelled by Python's tokenizer as code / comment / string, read as
``[CLS] <2 previous lines> [SEP] <the line> [SEP]`` (token types 0 / 1), 128 bytes. Train:
the 133 train modules (~96k lines); eval: 16 batches (512 lines) drawn at random from the 14
held-out modules. Always answering "code" scores 70.7% on train (the majority baseline).
Model: the ``bert_mlm_stdlib`` architecture (4 layers, width 128, 4 heads) with the pooler
and a 3-way classifier (860,419 parameters), no dropout. Optimiser: AdamW (0.9, 0.98),
warmup 30 + cosine to 1e-3 peak, clip 1.0.

Runtime here: 428 s from scratch and 508 s from the MLM run, 300 steps each, measured on this
2-core machine while it was shared with other jobs (load average ~8; median 3.2k tokens/s);
building the ~106k examples takes a few seconds of that.

Metric (measured 2026-11-29), eval accuracy on 512 held-out lines (majority class "code":
67.0% of them) at steps 100 / 200 / 300, and on all 10,370 held-out lines at the end
(``transformer-jax eval --workdir ... --batches 400``; majority baseline 65.2%):

    from scratch                          80.3% / 83.2% / 92.0%    all lines: 90.5%
    from bert_mlm_stdlib (600 MLM steps)  89.5% / 93.0% / 93.0%    all lines: 91.6%

Pretraining helps most early (+9 points at step 100); samples in ``samples.txt`` list a few
predictions with their true roles.
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="bert_classify_stdlib",
        task="classify",
        task_options=dict(context_lines=2),
        model="bert",
        model_preset="tiny",
        model_overrides=dict(num_layers=4, d_model=128, num_heads=4, max_len=128,
                             dropout_rate=0.0, attention_dropout_rate=0.0),
        seq_len=128,
        batch_size=32,
        steps=300,
        learning_rate=1e-3,
        warmup_steps=30,
        eval_every=100,
        eval_batches=16,
        save_every=300,
        sample_tokens=1,
    )
