"""``transformer-jax train --experiment bert_pretrain_stdlib --init-from DIR``: BERT
pretraining (MLM + NSP) continued from a Hugging Face ``BertForPreTraining`` directory
(random weights, a WordPiece tokenizer of 700 ids): every parameter, the MLM and NSP heads
included, is the checkpoint's, and metrics.jsonl has the NSP and MLM metrics, train and
eval. One run of 2 steps of a 1-layer model of width 8, through the CLI's ``main`` in this
process (nothing here needs a process of its own)."""
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cli_here
from tests.tokenizer_dirs import bert_dir
from transformer_jax.train.checkpoint import load_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SHORT = ["steps=2", "log_every=1", "eval_every=2", "save_every=2", "eval_batches=1",
         "batch_size=4", "seq_len=32", "warmup_steps=1",
         "learning_rate=1e-9"]      # AdamW moves each weight by ~1e-9 a step: still the checkpoint's


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random BertForPreTraining and its tokenizer, saved by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("hf") / "bert"
    bert_dir(root)                                  # tokenizer files + a BertConfig of width 8
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(transformers.BertConfig.from_pretrained(root))
    model.save_pretrained(root)
    return root, model


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_dir, data_dir):
    workdir = tmp_path_factory.mktemp("pretrain") / "run"
    code, out, lines = cli_here("train", "--experiment", "bert_pretrain_stdlib", "--init-from",
                           str(hf_dir[0]), "--workdir", str(workdir), "--no-progress",
                           *(f"--set={o}" for o in SHORT), f"--set=data_dir={data_dir}")
    assert code == 0 and not [line for line in lines if line.startswith("error:")], lines
    return workdir, out


def test_continued_pretraining_loads_both_heads(run, hf_dir):
    workdir, out = run
    model = hf_dir[1]
    assert f"init-from {hf_dir[0]} (hf, bert): " in out and "initialised fresh" not in out
    config = json.loads((workdir / "config.json").read_text())
    assert config["init_from"]["fresh"] == [] and config["task"] == "pretrain"
    assert config["task_spec"]["tokenizer"] == f"hf:{hf_dir[0]}"
    assert config["model"]["head"] == "pretraining" and config["model"]["vocab_size"] == 700
    _, params = load_params(workdir)
    hf = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    pairs = {("nsp", "kernel"): hf["cls.seq_relationship.weight"].T,
             ("nsp", "bias"): hf["cls.seq_relationship.bias"],
             ("mlm", "transform", "kernel"): hf["cls.predictions.transform.dense.weight"].T,
             ("mlm", "bias"): hf["cls.predictions.bias"],
             ("bert", "pooler", "kernel"): hf["bert.pooler.dense.weight"].T}
    for path, want in pairs.items():
        got = params
        for key in path:
            got = got[key]
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, err_msg="/".join(path))


def test_metrics_have_nsp_and_mlm_accuracy(run):
    rows = [json.loads(line) for line in (Path(run[0]) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "nsp_accuracy" in r]
    evals = [r for r in rows if "eval_nsp_accuracy" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [2]
    for r in train:
        assert {"loss", "mlm_loss", "mlm_accuracy", "nsp_loss"} <= set(r)
        assert r["tokens"] == 4                       # the weight: 4 pairs
        assert r["loss"] == pytest.approx(r["mlm_loss"] + r["nsp_loss"], rel=1e-5)
        assert 0 <= r["mlm_accuracy"] <= 1 and r["nsp_accuracy"] in (0, 0.25, 0.5, 0.75, 1)
    e = evals[0]
    assert e["eval_tokens"] == 4 and e["eval_nsp_accuracy"] in (0, 0.25, 0.5, 0.75, 1)
    assert e["eval_loss"] == pytest.approx(e["eval_mlm_loss"] + e["eval_nsp_loss"], rel=1e-5)
    assert 0 <= e["eval_mlm_accuracy"] <= 1
