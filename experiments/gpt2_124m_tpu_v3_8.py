"""GPT-2 124M on WikiText-103 (or LM1B), data parallel over the 8 TPU cores of a TPU v3-8 (or v2-8).

Colab retired its v2-8 in September 2025 and offers single chips now: there, use
``gpt2_124m_tpu_v5e_1``. On a v3-8 / v2-8 TPU VM (or a notebook that still has one):

    pip install -e ".[tpu]"                          # in a clone of this repository
    transformer-jax train --experiment gpt2_124m_tpu_v3_8 \\
        --workdir /content/drive/MyDrive/runs/gpt2_124m_tpu_v3_8 --no-progress
    # after a disconnect, the same command plus --resume continues at the exact batch

Check it first, from any machine: ``transformer-jax compile --experiment
gpt2_124m_tpu_v3_8 --tpu v3-8`` (or ``--tpu v2-8``).

Devices: one process sees 8 TPU devices (v2/v3 expose each core); ``mesh="data=-1"`` puts
them all on the ``data`` axis: parameters and Adam state replicated (124M x 12 bytes =
1.5 GB per core), the global batch of 256 sequences split 32 per core, one jitted step with
sharded inputs (``--parallelism jit``, the default). ``--parallelism pmap`` gives the same
losses. ``--mesh fsdp=8`` shards parameters and Adam state 8 ways (0.19 GB per core; XLA
then all-gathers each weight where it is used): the knob for GPT-2 medium/large on the
8 GB cores of a v2-8. Checkpoints restore onto any mesh (``--resume --mesh ...``).

Data: WikiText-103 (``hf:Salesforce/wikitext:wikitext-103-raw-v1``, Hugging Face
``datasets``: downloaded into ``$HF_HOME`` on first use, needs a network, no TensorFlow;
train and validation splits; the train split has 1.8M rows, so it is packed in stream
mode), a 32k SentencePiece vocabulary trained into the workdir from 200k training rows,
packed into windows of 512 tokens. WikiText-103 holds about 103M words, so 20k steps pass
over it many times (how much that overfits: not measured here). TFDS ``lm1b`` (30M
sentences) stays available where TensorFlow is installed to prepare it (or its prepared
array_record folder is copied into ``data_dir``): ``--set dataset=lm1b --set
eval_split=test``; docs/datasets.md lists the other corpora.

Mixed precision: bf16 compute, fp32 parameters and Adam moments; layers
scanned (compile time flat in depth) and rematerialised (activation memory). Attention:
``attention_impl="auto"`` takes XLA's attention on v2/v3 (Mosaic compiles Pallas kernels
for v4 and later only) and the Pallas flash kernel on the v4-32 and v5e variants of this
recipe; the kernel has no attention dropout, so the recipe keeps dropout on the residual
stream only (as nanoGPT and llm.c do). The run prints its attention path when it starts.

Compiled for the slices on a CPU host (``transformer-jax compile``, libtpu 0.0.42, jax
0.10.2): per device 4.95 GiB of 16 (parameters 0.41, AdamW moments 0.82, temporaries 3.72); v2-8: 4.95 GiB of 8. GPT-2 large on a v2-8 (``--set
model_preset=gpt2-large``): 16.30 GiB of 8 with ``--mesh data=-1`` (does not fit the 8 GiB
cores), 7.35 GiB of 8 with ``--mesh fsdp=-1``.

Runtime: not measured (this machine has no TPU). Estimate from the model FLOPs: 7.14e8
training FLOP per token (``GPTConfig.flops_per_token(512)``) x 131,072 tokens per step =
9.36e13 FLOP per step; at 40% of the v3-8's 8 x 61.5 TFLOP/s bf16 peak that is 0.48 s per
step, ~2.6 h for 20k steps (2.6B tokens; ~3 epochs of lm1b); a v2-8 (8 x 22.5 TFLOP/s) takes
~7.2 h. Metric: not measured; ``eval_ppl`` (per SentencePiece token on the validation split)
is logged every 2000 steps.
"""
from transformer_jax.train.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="gpt2_124m_tpu_v3_8",
        model="gpt",
        model_preset="gpt2",
        model_overrides=dict(max_len=512, dtype="bfloat16", scan_layers=True, remat=True,
                             dropout_rate=0.1, attention_dropout_rate=0.0),
        dataset="hf:Salesforce/wikitext:wikitext-103-raw-v1",
        eval_split="validation",
        tokenizer="sentencepiece",
        sentencepiece_vocab_size=32000,
        seq_len=512,
        batch_size=256,
        steps=20_000,
        schedule="warmup_cosine",
        learning_rate=6e-4,
        warmup_steps=1000,
        end_learning_rate=6e-5,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,
        parallelism="jit",
        mesh="data=-1",
        log_every=100,
        eval_every=2000,
        eval_batches=64,
        save_every=1000,
        keep=3,
        sample_prompt="The",
        sample_tokens=48,
    )
