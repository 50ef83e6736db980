"""The smallest run the loop tests train: a 1-layer GPT of width 32 on the embedded corpus."""
from transformer_jax.train.config import ExperimentConfig, apply_overrides

TINY = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=64",
    "seq_len=32", "batch_size=4", "schedule=constant", "learning_rate=3e-3", "warmup_steps=2",
    "log_every=1", "eval_every=5", "save_every=5", "eval_batches=2", "sample_tokens=8",
]


def tiny_cfg(data_dir, **extra) -> ExperimentConfig:
    """TINY in `data_dir`, with `extra` as further `--set key=value` overrides."""
    return apply_overrides(ExperimentConfig(), TINY + [f"data_dir={data_dir}"]
                           + [f"{k}={v}" for k, v in extra.items()])
