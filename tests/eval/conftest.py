"""Model directories and tasks the harness tests share: built offline, once per session."""
import os

import pytest

# before the datasets library is imported (it reads them once): the tasks are local files
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lm_eval")

import torch  # noqa: E402
import transformers  # noqa: E402

from tests.tokenizer_dirs import CORPUS, gpt2_dir, llama_style_dir, llama_tokenizer  # noqa: E402,F401

MAX_LEN = 128      # short, so that the rolling task's longer documents take several windows


def hf_env() -> None:
    """No network for the datasets library and the hub (the tasks are local JSONL files)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory):
    from transformer_jax.data.harness_tasks import write_stdlib_tasks
    hf_env()
    return write_stdlib_tasks(tmp_path_factory.mktemp("harness_tasks"))


@pytest.fixture(scope="session")
def gpt2_hf(tmp_path_factory):
    """A random GPT-2 (2 layers, width 32, max_len 128) with its own BPE tokenizer."""
    root = tmp_path_factory.mktemp("gpt2")
    gpt2_dir(root)
    config = transformers.GPT2Config.from_pretrained(root)
    config.update(dict(n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root)
    return str(root)


@pytest.fixture(scope="session", params=["llama3", "qwen2", "qwen3"])
def llama_hf(request, tmp_path_factory):
    """A random Llama 3 (RoPE scaling), Qwen 2.5 or Qwen 3 (RoPE, RMSNorm, SwiGLU, 2 kv heads
    of 4; tests/tokenizer_dirs.py ``llama_style_dir``) whose tokenizer adds bos."""
    root = tmp_path_factory.mktemp(request.param)
    llama_style_dir(root, request.param, max_len=MAX_LEN)
    return str(root)


@pytest.fixture(scope="session")
def gemma_hf(tmp_path_factory):
    """A random Gemma 3 (local, local, global layers; window 16 < MAX_LEN; linear RoPE
    scaling on the global layer) with the Llama test tokenizer (it adds bos)."""
    root = tmp_path_factory.mktemp("gemma")
    llama_tokenizer(root)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=MAX_LEN, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=None)).save_pretrained(root)
    return str(root)


@pytest.fixture(scope="session")
def finetuned(tmp_path_factory, gpt2_hf):
    """A run fine-tuned here from ``gpt2_hf`` for 3 steps (its BPE tokenizer), and its export
    as a Hugging Face directory: (workdir, export)."""
    from transformer_jax.cli import main

    root = tmp_path_factory.mktemp("finetuned")
    workdir, export = root / "run", root / "export"
    sets = ["steps=3", "log_every=1", "eval_every=3", "save_every=3", "eval_batches=1",
            "sample_tokens=0", "batch_size=4", "seq_len=32", "learning_rate=1e-2",
            "warmup_steps=1", f"data_dir={root / 'tfds'}"]
    # in this process: the CLI's imports are paid once
    assert main(["train", "--no-progress", "--init-from", gpt2_hf, "--workdir", str(workdir),
                 *(f"--set={s}" for s in sets)]) == 0
    assert main(["export", "--workdir", str(workdir), "--out", str(export)]) == 0
    return str(workdir), str(export)


def _train_and_export(root, *sets: str) -> tuple[str, str]:
    """A tiny GPT (tests/helpers.py TINY_RUN) trained 3 steps in ``root/run`` with ``sets``
    on top, and its export as a Hugging Face directory ``root/export``: (workdir, export)."""
    from tests.helpers import TINY_RUN
    from transformer_jax.cli import main

    workdir, export = root / "run", root / "export"
    sets = [*TINY_RUN, "steps=3", "eval_every=3", "save_every=3", "sample_tokens=0",
            f"data_dir={root / 'tfds'}", *sets]
    assert main(["train", "--no-progress", "--workdir", str(workdir),
                 *(f"--set={s}" for s in sets)]) == 0
    assert main(["export", "--workdir", str(workdir), "--out", str(export)]) == 0
    return str(workdir), str(export)


@pytest.fixture(scope="session")
def byte_run(tmp_path_factory):
    """A tiny run with the default byte tokenizer, and its export: (workdir, export)."""
    return _train_and_export(tmp_path_factory.mktemp("byte_run"))


@pytest.fixture(scope="session")
def spm_run(tmp_path_factory):
    """A tiny run with a SentencePiece unigram (600 pieces, trained on
    tests/tokenizer_dirs.py's CORPUS), and its export: (workdir, export)."""
    from transformer_jax.data.tokenizers import train_sentencepiece

    root = tmp_path_factory.mktemp("spm_run")
    train_sentencepiece(CORPUS, 600, root / "spm.model", num_threads=1)
    return _train_and_export(root, f"tokenizer=sentencepiece:{root / 'spm.model'}")
