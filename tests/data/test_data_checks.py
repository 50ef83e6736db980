"""The data a run reads, checked before it writes anything (issue 55): every split it reads
is opened (``Task.check_data``, from ``run.setup``) and must hold rows and the fields its
task reads. Each problem is one ``error:`` line, exit 2, and the workdir is never created.
And labels that are strings, mapped to ids as ``datasets``' ``class_encode_column`` does:
stored with the run, read back by eval, written to the export's ``id2label``."""
import io
import json
import os

import datasets
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from tests.helpers import TINY_RUN, tiny_cfg
from transformer_jax import data
from transformer_jax.data import images as image_data
from transformer_jax.errors import UserError

pytestmark = pytest.mark.colab   # the hf: datasets: also against Colab's versions

TINY = [a for kv in TINY_RUN for a in ("--set", kv)]
TEXTS = [f"document {i}: " + "word " * (i % 5 + 1) for i in range(16)]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """`datasets` converts data files into Arrow in its cache: one per test."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def texts(column="text", rows=TEXTS):
    return datasets.Dataset.from_dict({column: list(rows)})


def refused(here, tmp_path, *sets, experiment="stdlib_gpt") -> list[str]:
    """The error lines of a ``train`` of ``experiment`` (TINY_RUN, ``sets`` on top) that
    must be refused: exit 2, and no workdir."""
    code, _, lines = here("train", "--experiment", experiment, "--workdir", tmp_path / "w",
                          "--no-progress", *TINY, *[a for kv in sets for a in ("--set", kv)])
    assert code == 2, lines
    assert not (tmp_path / "w").exists()
    return lines


# ----------------------------------------------------------------------------- 1: eval split

def test_a_missing_eval_split_is_refused_at_start(here, tmp_path):
    """One data file is a train split only: refused before anything runs, naming the fix."""
    from transformer_jax.tasks import check_data

    path = tmp_path / "one.parquet"
    texts().to_parquet(str(path))
    assert refused(here, tmp_path, f"dataset=hf:{path}") == [
        f"error: dataset 'hf:{path}' has no 'validation' split to evaluate on (its splits: "
        "['train']); set --set eval_split=NAME to one of them (eval_split=train scores the "
        "training rows), or give the held-out rows a split of their own (a directory with "
        "train.parquet and validation.parquet, as hf:DIR)"]
    check_data(tiny_cfg(tmp_path / "d", dataset=f"hf:{path}", eval_split="train"))   # the fix


def _captions(n=8):
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"image": [_png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(n)],
         "caption": [f"picture number {i}" for i in range(n)]}, features=features)


def _png(array):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def test_the_clip_caption_recipe(here, tmp_path):
    """docs/datasets.md's recipe for clip_digits on your own captions: a DIR of parquet files
    with image and caption columns passes the check when it has the test split clip_digits
    evaluates on, and is refused at start, with the way out, when it has train only."""
    from transformer_jax.tasks import check_data
    from transformer_jax.train.config import apply_overrides, load_experiment

    root = tmp_path / "captions"
    root.mkdir()
    _captions().to_parquet(str(root / "train.parquet"))
    code, _, lines = here("train", "--experiment", "clip_digits", "--workdir", tmp_path / "w",
                          "--set", f"dataset=hf:{root}", "--set", "task.caption_key=caption")
    assert code == 2 and lines == [
        f"error: dataset 'hf:{root}' has no 'test' split to evaluate on (its splits: ['train']); "
        "set --set eval_split=NAME to one of them (eval_split=train scores the training rows), "
        "or give the held-out rows a split of their own (data files named test.parquet or "
        "test-*.parquet beside the train ones)"]
    assert not (tmp_path / "w").exists()
    _captions().to_parquet(str(root / "test.parquet"))
    check_data(apply_overrides(load_experiment("clip_digits"), [
        f"dataset=hf:{root}", "task.caption_key=caption"]))


# ----------------------------------------------------------------------------- 2: no rows

def _empty_jsonl(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path / "empty.jsonl", "{path} holds no rows, so split 'train' is empty; give it rows"


def _empty_parquet(tmp_path):
    texts(rows=[]).cast(datasets.Features({"text": datasets.Value("string")})).to_parquet(
        str(tmp_path / "empty.parquet"))
    return tmp_path / "empty.parquet", "{path} holds no rows, so split 'train' is empty; give it rows"


def _empty_saved_split(tmp_path):
    empty = texts(rows=[]).cast(datasets.Features({"text": datasets.Value("string")}))
    datasets.DatasetDict({"train": texts(), "validation": empty}).save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved", ("split 'validation' is empty (no rows in {path}/validation); "
                                "give it rows, or set --set eval_split=NAME to a split that has "
                                "some")


@pytest.mark.parametrize("make", [_empty_jsonl, _empty_parquet, _empty_saved_split],
                         ids=["jsonl", "parquet", "save_to_disk"])
def test_an_empty_file_or_split_is_one_line(here, tmp_path, make):
    path, message = make(tmp_path)
    sep = " " if make is _empty_saved_split else ": "
    assert refused(here, tmp_path, f"dataset=hf:{path}") == [
        f"error: dataset 'hf:{path}'{sep}{message.format(path=path)}"]


def test_an_empty_file_beside_others_is_named(tmp_path):
    """In a directory, the one split whose file is empty is refused, naming the file; the
    other split still reads."""
    root = tmp_path / "corpus"
    root.mkdir()
    texts().to_parquet(str(root / "train.parquet"))
    texts(rows=[]).cast(datasets.Features({"text": datasets.Value("string")})).to_parquet(
        str(root / "validation.parquet"))
    assert data.load_texts(f"hf:{root}", "train") == TEXTS
    with pytest.raises(UserError) as e:
        data.load_texts(f"hf:{root}", "validation")
    assert str(e.value) == (f"dataset 'hf:{root}': {root / 'validation.parquet'} holds no rows, "
                            "so split 'validation' is empty; give it rows, or remove it")


# ----------------------------------------------------------------------------- 3: no such file

def test_a_missing_data_file_is_no_hub_repository(here, tmp_path):
    """A relative name with a data file's extension that is not there: a missing file, at
    once (never a Hub download, 30 s of retries)."""
    lines = refused(here, tmp_path, "dataset=hf:data/nothere.parquet")
    assert lines == [
        f"error: dataset 'hf:data/nothere.parquet': there is no file "
        f"{os.path.abspath('data/nothere.parquet')}; check the path (a relative one starts in "
        f"the current directory, {os.getcwd()})"]


# ----------------------------------------------------------------------------- 4: configs

@pytest.fixture
def two_configs(tmp_path):
    """A Hub repository's layout with two configurations, en/ and fr/, each with a train and
    a validation file."""
    root = tmp_path / "repo"
    for config in ("en", "fr"):
        (root / config).mkdir(parents=True)
        for split in ("train", "validation"):
            texts(rows=[f"{config} {split} {i}" for i in range(6)]).to_parquet(
                str(root / config / f"{split}-00000-of-00001.parquet"))
    return root


README = """---
configs:
- config_name: english
  data_files:
  - split: train
    path: en/train-*.parquet
  - split: validation
    path: en/validation-*.parquet
- config_name: french
  data_files:
  - split: train
    path: fr/train-*.parquet
  - split: validation
    path: fr/validation-*.parquet
---
"""


def test_configurations_must_be_named(here, tmp_path, two_configs):
    """Without a README the two config folders would train as one split: refused, listing
    them; with a README declaring configurations, those are listed; either, named, reads
    its own rows only."""
    root = two_configs
    assert refused(here, tmp_path, f"dataset=hf:{root}") == [
        f"error: dataset 'hf:{root}': the subfolders ['en', 'fr'] look like configurations (no "
        "README.md declares any), and without one named their data files would train as one "
        f"split; name one: dataset=hf:{root}:en"]
    assert data.load_texts(f"hf:{root}:fr", "validation") == [f"fr validation {i}" for i in range(6)]
    (root / "README.md").write_text(README)
    assert refused(here, tmp_path, f"dataset=hf:{root}") == [
        f"error: dataset 'hf:{root}' has configurations ['english', 'french'] (its README.md); "
        f"name one: dataset=hf:{root}:english"]
    assert data.load_texts(f"hf:{root}:french", "train") == [f"fr train {i}" for i in range(6)]


# ----------------------------------------------------------------------------- 6, 14: fields

def test_an_empty_text_cell_names_the_row(here, tmp_path):
    """A CSV with an empty text cell (pandas writes it as nothing; datasets reads a null)."""
    path = tmp_path / "gaps.csv"
    pd.DataFrame({"text": ["a b c", "d e f", None, "g h"] * 4}).to_csv(path, index=False)
    assert refused(here, tmp_path, f"dataset=hf:{path}", "eval_split=train") == [
        f"error: dataset 'hf:{path}' split 'train' row 2 has no 'text' (an empty cell); drop "
        "the rows with empty cells, or fill them"]
    with pytest.raises(UserError, match=r"^row 1: document has no text \(None: an empty cell\?\); "
                                        r"drop the rows without text or fill them \(with ''\)$"):
        data.load_texts(["a b", None], "train")   # in memory: where the pipeline reads it


def test_a_missing_text_field_names_the_option(here, tmp_path):
    path = tmp_path / "web.parquet"
    texts("content").to_parquet(str(path))
    assert refused(here, tmp_path, f"dataset=hf:{path}", "eval_split=train") == [
        f"error: dataset 'hf:{path}' split 'train' row 0: document has no field 'text' (fields: "
        "['content']); name its text field with --set task.text_key=content"]


# ----------------------------------------------------------------------------- 5: string labels

SENTENCES = ["a fine film", "dull and long", "it was fine", "loved it", "a waste", "so-so"]
LABELS = ["positive", "negative", "neutral", "positive", "negative", "neutral"]
CLASSES = ["negative", "neutral", "positive"]   # sorted, as class_encode_column names them
BERT = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64",
        "seq_len=16", "batch_size=4", "steps=2", "warmup_steps=1", "eval_every=2",
        "eval_batches=1", "save_every=2", "log_every=1"]


def _sentiment(root, validation_labels=LABELS):
    root.mkdir()
    datasets.Dataset.from_dict({"sentence": SENTENCES * 2, "label": LABELS * 2}).to_parquet(
        str(root / "train.parquet"))
    datasets.Dataset.from_dict({"sentence": SENTENCES, "label": list(validation_labels)}
                               ).to_parquet(str(root / "validation.parquet"))
    return f"hf:{root}"


def test_string_labels_train_and_export(here, tmp_path):
    """classify on labels that are strings: the classes are the sorted names, stored in the
    run's task spec, used again by eval (each row's id), and written as the export's
    id2label / label2id, which transformers reads."""
    import transformers

    from transformer_jax.workdir import load_run

    spec = _sentiment(tmp_path / "sst")
    code, _, lines = here("train", "--experiment", "bert_classify_stdlib", "--workdir",
                          tmp_path / "w", "--no-progress", "--set", f"dataset={spec}",
                          *[a for kv in BERT for a in ("--set", kv)])
    assert code == 0, lines
    run = json.loads((tmp_path / "w" / "config.json").read_text())
    assert run["task_spec"]["classes"] == CLASSES and run["model"]["num_classes"] == 3
    _, _, _, task = load_run(tmp_path / "w")
    assert task.encoded("validation")["labels"].tolist() == [CLASSES.index(x) for x in LABELS]
    code, _, lines = here("export", "--workdir", tmp_path / "w", "--out", tmp_path / "hf")
    assert code == 0, lines
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert exported["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").id2label == dict(enumerate(CLASSES))


def test_string_label_refusals(here, tmp_path):
    """task.num_classes against string labels, and an eval label the train split lacks:
    refused at start."""
    spec = _sentiment(tmp_path / "a", ["positive", "negative", "mixed"] * 2)
    lines = refused(here, tmp_path, f"dataset={spec}", *BERT, experiment="bert_classify_stdlib")
    assert lines == [f"error: dataset {spec!r} split 'validation' has labels ['mixed'] that the "
                     "train split lacks (its classes: ['negative', 'neutral', 'positive']); drop "
                     "those rows or relabel them"]
    spec = _sentiment(tmp_path / "b")
    lines = refused(here, tmp_path, f"dataset={spec}", "task.num_classes=2", *BERT,
                    experiment="bert_classify_stdlib")
    assert lines == [f"error: task.num_classes=2, but the 'label' labels of {spec!r} (train "
                     "split) are 3 strings ['negative', 'neutral', 'positive']; drop "
                     "task.num_classes (string labels are mapped to ids, sorted)"]


def test_image_string_labels(tmp_path):
    """An image set whose label column holds strings is labelled: the classes are the sorted
    names, every split's rows map to their ids, and an eval label the train split lacks is
    refused by the check."""
    from transformer_jax.tasks import check_data
    from transformer_jax.train.config import apply_overrides, load_experiment

    rng = np.random.default_rng(1)
    names = ["owl", "cat", "dog", "cat", "owl", "dog"]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})

    def split(labels):
        return datasets.Dataset.from_dict(
            {"image": [_png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in labels],
             "label": labels}, features=features)

    root = tmp_path / "pets"
    root.mkdir()
    split(names).to_parquet(str(root / "train.parquet"))
    split(names[::-1]).to_parquet(str(root / "test.parquet"))
    spec = f"hf:{root}"
    info = image_data.dataset_info(spec)
    assert (info.num_classes, info.label_names) == (3, ("cat", "dog", "owl"))
    batch = next(image_data.make_image_iterator(spec, "test", image_size=8, batch_size=6,
                                                shuffle=False, repeat=False, info=info,
                                                workers=0))
    assert batch["labels"].tolist() == [["cat", "dog", "owl"].index(n) for n in names[::-1]]
    cfg = apply_overrides(load_experiment("vit_digits"), [f"dataset={spec}"])
    check_data(cfg)
    split(["cat", "emu"]).to_parquet(str(root / "test.parquet"))
    with pytest.raises(UserError) as e:
        check_data(cfg)
    assert str(e.value) == (f"dataset {spec!r} split 'test' has labels ['emu'] that the train "
                            "split lacks (its classes: ['cat', 'dog', 'owl']); drop those rows "
                            "or relabel them")


def test_an_image_that_does_not_decode(here, tmp_path):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(
        names=["a", "b"])})
    path = tmp_path / "broken.parquet"
    datasets.Dataset.from_dict({"image": [{"bytes": b"not a png", "path": None}] * 2,
                                "label": [0, 1]}, features=features).to_parquet(str(path))
    code, _, lines = here("train", "--experiment", "vit_digits", "--workdir", tmp_path / "w",
                          "--set", f"dataset=hf:{path}", "--set", "eval_split=train")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        f"error: dataset 'hf:{path}' split 'train' row 0: its 'image' does not decode as an "
        "image (UnidentifiedImageError: cannot identify image file")
    assert lines[0].endswith("; fix or drop the row") and not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------- 15: quiet

def test_no_progress_silences_datasets_bars(capfd, tmp_path):
    """``datasets`` draws a bar preparing a split; under --no-progress stderr holds the one
    error line alone (a refused run: the train split was prepared before the refusal)."""
    from transformer_jax.cli import main

    for name, flags in (("quiet", ["--no-progress"]), ("bars", [])):
        path = tmp_path / f"{name}.parquet"
        texts().to_parquet(str(path))
        capfd.readouterr()
        assert main(["train", "--workdir", str(tmp_path / name), *flags, *TINY,
                     "--set", f"dataset=hf:{path}"]) == 2
        err = capfd.readouterr().err
        if flags:
            assert err.splitlines() == [next(x for x in err.splitlines() if x.startswith("error:"))]
        else:
            assert "Generating train split" in err   # what --no-progress silences
