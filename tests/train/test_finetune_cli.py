"""Fine-tuning runs through the CLI when something is off: adapters that would train
nothing, a resume that must keep the run's settings (or refuse a changed adapter), a
checkpoint of another family or with too small a vocabulary. Each test asserts the lines
the user sees and the state of the workdir afterwards.

One LoRA run (rank 4 over a tiny random HF GPT-2, 2 steps, learning rate 1e-2, warm-up 1)
is trained once; the test that trains further copies it, the refused runs use it as it
is. Every run goes through the CLI's ``main`` in this process (the same lines and exit
status, without a process start and its imports each; nothing here needs a process of
its own).
"""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.helpers import cli_here, snapshot
from tests.interop.conftest import gpt2_model
from transformer_jax.cli import main as cli_main
from transformer_jax.interop import from_hf
from transformer_jax.train.optim import make_schedule

pytestmark = pytest.mark.slow

VOCAB = 300      # byte tokens: 259 ids
SHORT = ["steps=2", "log_every=1", "eval_every=2", "save_every=2", "eval_batches=1",
         "sample_tokens=0", "batch_size=4", "seq_len=32"]
LORA = ["--set=lora.rank=4", "--set=learning_rate=1e-2", "--set=warmup_steps=1"]


def train(*args, data_dir):
    """``transformer-jax train`` with the short settings (for a module-scoped fixture)."""
    return cli_here("train", "--no-progress", *(f"--set={o}" for o in SHORT),
                    f"--set=data_dir={data_dir}", *args)


def refused(capsys, *args, data_dir=None):
    """``transformer-jax train ARGS`` (with the short settings when ``data_dir`` is given)
    in this process: (exit status, stdout, the warning:/error: lines)."""
    short = [] if data_dir is None else [*(f"--set={o}" for o in SHORT), f"--set=data_dir={data_dir}"]
    code = cli_main(["train", "--no-progress", *short, *args])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith(("warning:", "error:"))]


def flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random HF GPT-2 (vocabulary 300, no tokenizer files)."""
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    gpt2_model(vocab_size=VOCAB, n_positions=64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_dir, data_dir):
    """The LoRA run (2 steps), what its first `train` printed and its warning lines."""
    workdir = tmp_path_factory.mktemp("lora") / "run"
    code, out, lines = train("--init-from", str(hf_dir), "--workdir", str(workdir), *LORA,
                             data_dir=data_dir)
    assert code == 0, lines
    return workdir, out, lines


def tokenizer_warning(hf_dir) -> str:
    return (f"warning: --init-from {hf_dir}: no tokenizer files there (tokenizer.json, "
            "spiece.model, tokenizer.model), so the run tokenizes bytes; "
            "if the weights were trained with another tokenizer, give it as --set "
            "tokenizer=hf:DIR (a directory with its tokenizer.json)")


def test_a_lora_run_says_what_trains(lora_run, hf_dir):
    # no model setting given: the only warning is the tokenizer's (the default experiment's
    # model settings, for training from scratch, are not reported as not applying)
    assert lora_run[2] == [tokenizer_warning(hf_dir)]
    # rank 4 on the query and value of 2 layers: lora_a (64, 4) + lora_b (4, 4, 16) each
    base = sum(np.size(x) for x in flat(jax.tree_util.tree_map(np.asarray, from_hf(hf_dir)[1])).values())
    lora = 4 * (64 * 4 + 4 * 64)
    total = base + lora
    assert (f"trainable parameters: {lora:,} of {total:,} ({lora / total:.2%}): LoRA {lora:,} "
            f"(rank 4 on 4 Dense layers matching 'attn/(query|value)'); frozen: {base:,}\n") in lora_run[1]


def test_lora_targets_that_match_nothing_are_refused(hf_dir, data_dir, tmp_path, capsys):
    code, _, lines = refused(capsys, "--init-from", str(hf_dir), "--workdir", str(tmp_path / "run"),
                             *LORA, "--set=lora.targets=nomatch", data_dir=data_dir)
    assert code == 2 and len(lines) == 2 and lines[0] == tokenizer_warning(hf_dir) and lines[-1] == (
        "error: lora.targets='nomatch' matches none of the model's 12 Dense layers (h_0/mlp/wi, "
        "h_0/mlp/wo, h_0/self_attn/key, h_0/self_attn/out, h_0/self_attn/query, "
        "h_0/self_attn/value, h_1/mlp/wi, h_1/mlp/wo and 4 more), so LoRA would train nothing; "
        "give a regex that is found in some of these paths, e.g. --set "
        "lora.targets='attn/(query|value)'")
    assert not (tmp_path / "run").exists()


def test_a_lora_run_resumed_as_the_readme_says_keeps_its_settings(lora_run, data_dir, tmp_path, here):
    """README step 2, literally: ``train --workdir DIR --resume --steps N``. The run goes on
    with its own learning rate, warm-up and batch (the experiment's defaults are 2e-3, 50 and
    32), and config.json keeps them."""
    workdir = tmp_path / "run"
    shutil.copytree(lora_run[0], workdir)
    before = json.loads((workdir / "config.json").read_text())
    code, _, lines = here("train", "--workdir", str(workdir), "--resume", "--steps", "4", "--no-progress")
    assert code == 0 and lines == [], lines
    after = json.loads((workdir / "config.json").read_text())
    assert after["experiment"] == {**before["experiment"], "steps": 4}
    assert after["init_from"] == before["init_from"] and after["model"] == before["model"]
    schedule = make_schedule("warmup_cosine", peak_lr=1e-2, warmup_steps=1, total_steps=4)
    logged = {r["step"]: r for r in rows(workdir) if "lr" in r}
    assert sorted(logged) == [1, 2, 3, 4]
    for step in (3, 4):    # the rate of the step's update: the schedule at step - 1
        assert logged[step]["lr"] == pytest.approx(float(schedule(step - 1)), rel=1e-6)
        assert logged[step]["tokens"] == 4 * 32
        assert logged[step]["grad_norm"] > 0


@pytest.mark.parametrize("change, line", [
    (["--set=lora.rank=8"], "error: the checkpoint in this workdir does not match the config: "
                            "model config differs (field: (checkpoint, now)) {'lora.rank': (4, 8)}. "),
    (["--set=lora.targets=attn/"],
     "error: the checkpoint in this workdir does not match the config: model config differs "
     "(field: (checkpoint, now)) {'lora.targets': ('attn/(query|value)', 'attn/')}. "),
    (["--set=batch_size=8"], "error: the checkpoint in this workdir does not match the config: "
                             "batch_size: checkpoint has 4, config has 8. "),
])
def test_a_resume_that_changes_the_adapter_or_the_batch_is_refused_by_name(lora_run, change, line,
                                                                          capsys):
    workdir = lora_run[0]
    before = snapshot(workdir)
    code, _, lines = refused(capsys, "--workdir", str(workdir), "--resume", "--steps", "4", *change)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(line), lines
    assert lines[0].endswith("Resume without the setting that changes it (the CLI's --resume takes "
                             "the run's settings from its config.json), or start in a new --workdir.")
    assert snapshot(workdir) == before


def test_a_resume_from_another_source_is_refused(lora_run, tmp_path, capsys):
    workdir = lora_run[0]
    before = snapshot(workdir)
    code, _, lines = refused(capsys, "--workdir", str(workdir), "--resume", "--steps", "4",
                             "--init-from", str(tmp_path))
    record = json.loads((workdir / "config.json").read_text())["init_from"]["path"]
    assert code == 2 and lines == [
        f"error: --init-from {tmp_path}: the run in {workdir} started from {record} "
        f"({workdir / 'config.json'}); --resume continues from its own checkpoint: drop "
        "--init-from, or start a new run in another --workdir"]
    assert snapshot(workdir) == before


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, data_dir):
    """A BERT masked-LM workdir (1 layer of width 32, 1 step)."""
    workdir = tmp_path_factory.mktemp("bert") / "run"
    code, _, lines = train("--experiment", "bert_mlm_stdlib", "--workdir", str(workdir), "--steps=1",
                           "--set=warmup_steps=0", "--set=model.num_layers=1",
                           "--set=model.d_model=32", "--set=model.num_heads=2", data_dir=data_dir)
    assert code == 0, lines
    return workdir


def test_init_from_a_checkpoint_of_another_family_is_refused(bert_run, data_dir, tmp_path, capsys):
    """A BERT MLM workdir under the default (GPT language-model) experiment: refused before
    anything is written, naming the family, the task and the experiments that fit."""
    code, out, lines = refused(capsys, "--init-from", str(bert_run), "--workdir",
                               str(tmp_path / "run"), "--set=warmup_steps=1", data_dir=data_dir)
    assert code == 2 and lines == [
        f"error: --init-from {bert_run} is a bert checkpoint (task 'mlm'), but experiment "
        "'stdlib_gpt' trains task 'lm', which needs a gpt or gemma model; a bert model trains 'classify' "
        "or 'mlm' or 'pretrain': choose an experiment for it (--experiment bert_classify_stdlib "
        "or bert_mlm_stdlib or bert_pretrain_stdlib), or --set task=mlm"]
    assert "parameter arrays loaded" not in out
    assert not (tmp_path / "run").exists()
    # the same model without --init-from: the task refuses it
    code, _, lines = refused(capsys, "--workdir", str(tmp_path / "run"), "--set=model=bert",
                             "--set=warmup_steps=1", data_dir=data_dir)
    assert code == 2 and lines == [
        "error: task 'lm' trains a decoder-only model (model=gpt: GPT-2, Llama, Mistral; "
        "model=gemma: Gemma 3), got model='bert'; set model=gpt or model=gemma, or the task a "
        "bert model trains (--set task=classify or "
        "task=mlm or task=pretrain)"]
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_vocabulary_smaller_than_the_tokenizer_says_where_each_comes_from(
        data_dir, tmp_path, capsys):
    """An HF GPT-2 of 256 ids without tokenizer files: the run tokenizes bytes (259 ids)."""
    hf = tmp_path / "gpt2_256"
    gpt2_model(vocab_size=256, n_positions=64).save_pretrained(hf)
    code, _, lines = refused(capsys, "--init-from", str(hf), "--workdir", str(tmp_path / "run"),
                             "--set=warmup_steps=1", data_dir=data_dir)
    assert code == 2 and len(lines) == 2 and lines[-1] == (   # after the tokenizer's warning
        f"error: the checkpoint {hf} has vocab_size=256, smaller than the 259 ids of the run's "
        "tokenizer, tokenizer='byte' (the default: the checkpoint brings no tokenizer files); "
        "give the tokenizer its weights were trained with as --set tokenizer=hf:DIR (a directory "
        "with its tokenizer.json), or use a checkpoint with vocab_size >= 259")
    assert not (tmp_path / "run").exists()
