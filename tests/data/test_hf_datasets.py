"""``hf:`` datasets (transformer_jax/data/hf_datasets.py) read from local files in their real
formats (parquet written by ``datasets``, a ``save_to_disk`` directory), without TensorFlow;
and the one-line refusals of TFDS datasets that need TensorFlow to prepare."""
import io
import math
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from tests.helpers import cli_here
from transformer_jax import data
from transformer_jax.data import images as image_data
from transformer_jax.data.hf_datasets import parse_hf_spec
from transformer_jax.data.sources import open_source
from transformer_jax.errors import UserError

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

TEXTS = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(60)]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """`datasets` converts data files into Arrow in its cache: one per test."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def parquet_dir(tmp_path):
    """A downloaded-repository layout: data/train-*.parquet, data/validation-*.parquet."""
    root = tmp_path / "corpus"
    (root / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": TEXTS[:48], "id": list(range(48))}).to_parquet(
        str(root / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"text": TEXTS[48:], "id": list(range(48, 60))}).to_parquet(
        str(root / "data" / "validation-00000-of-00001.parquet"))
    return root


def write_splits(root, splits: dict, fmt: str) -> str:
    """``splits`` (name -> Dataset) as a Hub repository's parquet files or a save_to_disk
    directory of Arrow files under ``root``; returns the ``hf:`` name."""
    if fmt == "arrow":
        datasets.DatasetDict(splits).save_to_disk(str(root))
    else:
        (root / "data").mkdir(parents=True)
        for name, split in splits.items():
            split.to_parquet(str(root / "data" / f"{name}-00000-of-00001.parquet"))
    return f"hf:{root}"


def test_parse_hf_spec():
    assert parse_hf_spec("hf:nyu-mll/glue:sst2") == ("nyu-mll/glue", "sst2")
    assert parse_hf_spec("hf:Salesforce/wikitext:wikitext-103-raw-v1") == (
        "Salesforce/wikitext", "wikitext-103-raw-v1")
    assert parse_hf_spec("hf:/tmp/corpus") == ("/tmp/corpus", None)
    assert parse_hf_spec("hf:/tmp/c:sub") == ("/tmp/c", "sub")
    with pytest.raises(UserError, match="names no data"):
        parse_hf_spec("hf:")


def test_parquet_splits_and_texts(parquet_dir):
    spec = f"hf:{parquet_dir}"
    assert data.load_texts(spec, "train") == TEXTS[:48]
    assert data.load_texts(spec, "validation") == TEXTS[48:]
    with pytest.raises(UserError) as e:
        open_source(spec, "test")
    assert str(e.value) == (
        f"dataset {spec!r} has no 'test' split to evaluate on (its splits: ['train', "
        "'validation']); set --set eval_split=NAME to one of them (eval_split=train scores the "
        "training rows), or give the held-out rows a split of their own (data files named "
        "test.parquet or test-*.parquet beside the train ones)")


def test_save_to_disk_and_single_file(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:30]}),
                               "test": datasets.Dataset.from_dict({"text": TEXTS[30:]})})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert data.load_texts(f"hf:{tmp_path / 'saved'}", "test") == TEXTS[30:]
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(tmp_path / "one.parquet"))
    assert data.load_texts(f"hf:{tmp_path / 'one.parquet'}", "train") == TEXTS
    with pytest.raises(UserError, match=r"no 'validation' split to evaluate on \(its splits: "
                                        r"\['train'\]\)"):
        open_source(f"hf:{tmp_path / 'one.parquet'}", "validation")
    with pytest.raises(UserError, match="neither a local file or directory nor a Hub repository"):
        open_source(f"hf:{tmp_path / 'missing'}", "train")


def _batches(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_lm_iterator_resumes_exactly(parquet_dir, tmp_path, mode):
    def make():
        return data.make_lm_iterator(f"hf:{parquet_dir}", "train", tokenizer="byte", seq_len=16,
                                     batch_size=4, seed=3, mode=mode, data_dir=str(tmp_path / "d"))

    it = make()
    kind = {"memory": "MemoryLMIterator", "stream": "StreamingLMIterator"}[mode]
    assert type(it).__name__ == kind
    first = _batches(it, 5)
    state = it.get_state()
    rest = _batches(it, 12)   # runs past an epoch boundary
    resumed = make()
    resumed.set_state(state)
    for a, b in zip(rest, _batches(resumed, 12)):
        for key in ("inputs", "targets", "weights"):
            np.testing.assert_array_equal(a[key], b[key])
    # the same batches as the same documents passed as a list of strings
    listed = data.make_lm_iterator(TEXTS[:48], "train", tokenizer="byte", seq_len=16,
                                   batch_size=4, seed=3, mode=mode)
    for a, b in zip(first + rest, _batches(listed, 17)):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def _png(array):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def image_parquet(tmp_path):
    rng = np.random.default_rng(0)
    arrays = rng.integers(0, 256, size=(12, 8, 8, 3), dtype=np.uint8)
    labels = [i % 3 for i in range(12)]
    features = datasets.Features({"img": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["cat", "dog", "fish"]),
                                  "caption": datasets.Value("string")})
    root = tmp_path / "images"
    root.mkdir()
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": _png(a), "path": None} for a in arrays], "label": labels,
         "caption": [f"picture number {i}" for i in range(12)]}, features=features)
    ds.to_parquet(str(root / "train.parquet"))
    ds.to_parquet(str(root / "test.parquet"))
    return root, arrays, labels


def test_image_source_and_info(image_parquet):
    root, arrays, labels = image_parquet
    spec = f"hf:{root}"
    info = image_data.dataset_info(spec)
    assert info == image_data.DatasetInfo(spec, 3, 3, 255.0, ("cat", "dog", "fish"), True)
    it = image_data.make_image_iterator(spec, "test", image_size=8, batch_size=5, shuffle=False,
                                        repeat=False, info=info)
    batches = list(it)
    images = np.concatenate([b["images"] for b in batches])[:12]
    expected = arrays.astype(np.float32) * (2 / 255) - 1
    np.testing.assert_allclose(images, expected, atol=1e-6)
    assert np.concatenate([b["labels"] for b in batches])[:12].tolist() == labels


@pytest.fixture
def caption_parquet(tmp_path):
    """coco-like image-caption pairs: JPEG images and a list of captions, no labels."""
    rng = np.random.default_rng(1)
    arrays = rng.integers(0, 256, size=(8, 12, 10, 3), dtype=np.uint8)

    def jpeg(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG")
        return {"bytes": buf.getvalue(), "path": None}

    ds = datasets.Dataset.from_dict(
        {"image": [jpeg(a) for a in arrays],
         "caption": [[f"picture number {i}", f"another view of {i}"] for i in range(8)]},
        features=datasets.Features({"image": datasets.Image(),
                                    "caption": datasets.Sequence(datasets.Value("string"))}))
    return write_splits(tmp_path / "captions", {"train": ds, "test": ds}, "parquet")


def test_contrastive_captions_from_hf(caption_parquet, tmp_path):
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    cfg = apply_overrides(load_experiment("clip_digits"), [
        f"dataset={caption_parquet}", "batch_size=4", f"data_dir={tmp_path / 'd'}"])
    task = make_task(cfg, tmp_path / "run")
    assert (task.caption_key, task.info.num_classes, task.info.num_channels) == ("caption", 0, 3)
    batch = next(iter(task.make_iterator("test", 0, 1, train=False)))
    rows = [task.tokenizer.decode(batch["input_ids"][r][batch["attention_mask"][r] > 0][:-1]
                                  .tolist()) for r in range(4)]   # eos dropped
    assert rows == [f"picture number {i}" for i in range(4)]   # eval: each image's first
    assert batch["images"].shape[1:] == (task.image_size, task.image_size, 3)
    assert batch["labels"].tolist() == [-1] * 4


def test_image_classification_refuses_a_caption_set(caption_parquet, tmp_path):
    code, _, lines = cli_here("train", "--experiment", "vit_digits", "--workdir", tmp_path / "w",
                              "--set", f"dataset={caption_parquet}")
    assert code == 2 and lines == [
        f"error: dataset {caption_parquet!r} has no label column to classify by (image-caption "
        "pairs?); train task=contrastive on it, or use a dataset with a ClassLabel column"]


def test_vit_trains_on_hf_images(image_parquet, tmp_path):
    """vit_digits on PNG images in parquet: a run; the model takes the hf set's classes and
    channels, and the run records its class names."""
    root, _, _ = image_parquet
    small = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64",
             "steps=2", "batch_size=4", "warmup_steps=1", "eval_every=2", "eval_batches=1",
             "save_every=2", "log_every=1"]
    code, _, lines = cli_here("train", "--experiment", "vit_digits", "--workdir", tmp_path / "w",
                              "--no-progress", "--set", f"dataset=hf:{root}",
                              *[x for kv in small for x in ("--set", kv)])
    assert code == 0, lines
    import json
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    assert (config["model"]["num_classes"], config["model"]["num_channels"]) == (3, 3)
    assert config["task_spec"]["label_names"] == ["cat", "dog", "fish"]


SENTENCES = ["a fine film", "dull and long", "loved it", "a waste", "great acting", "boring"]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_classify_reads_labelled_sentences(tmp_path, fmt):
    """glue/sst2's columns (sentence, ClassLabel label, idx); the classes come from the
    ClassLabel (kept in the parquet files' metadata, as on the Hub)."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"]),
                                  "idx": datasets.Value("int32")})
    split = datasets.Dataset.from_dict({"sentence": SENTENCES, "label": [1, 0, 1, 0, 1, 0],
                                        "idx": list(range(6))}, features=features)
    spec = write_splits(tmp_path / "sst2", {"train": split, "validation": split}, fmt)
    cfg = apply_overrides(load_experiment("bert_classify_stdlib"), [
        f"dataset={spec}", "eval_split=validation", "batch_size=2", "seq_len=16",
        f"data_dir={tmp_path / 'd'}"])
    task = make_task(cfg, tmp_path / "run")
    assert task.classes == ["negative", "positive"]
    enc = task.encoded("validation")
    assert enc["labels"].tolist() == [1, 0, 1, 0, 1, 0]
    tok = task.vocab.tokenizer
    first = enc["input_ids"][0]
    assert first[0] == task.vocab.cls_id and tok.decode(first[1:1 + len(tok.encode(
        SENTENCES[0]))].tolist()) == SENTENCES[0]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_seq2seq_reads_translation_pairs(tmp_path, fmt):
    """wmt14's layout: a translation column of {de, en} dicts."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    pairs = [("ein Haus", "a house"), ("der Hund", "the dog"), ("gut", "good")]
    features = datasets.Features({"translation": datasets.Translation(["de", "en"])})
    ds = datasets.Dataset.from_dict({"translation": [{"de": d, "en": e} for d, e in pairs]},
                                    features=features)
    spec = write_splits(tmp_path / "wmt", {"train": ds, "validation": ds}, fmt)
    cfg = apply_overrides(load_experiment("t5_stdlib_seq2seq"), [
        f"dataset={spec}", "eval_split=validation", "batch_size=2",
        f"data_dir={tmp_path / 'd'}"])   # the task's default keys: de, en
    task = make_task(cfg, tmp_path / "run")
    got = task._pairs("validation", train=False)
    assert got.get(range(3)) == pairs


@pytest.mark.parametrize("experiment, dataset, alternative", [
    ("stdlib_gpt", "lm1b", "hf:Salesforce/wikitext:wikitext-103-raw-v1 (no TensorFlow needed)"),
    ("bert_classify_stdlib", "glue/sst2", "hf:nyu-mll/glue:sst2 (no TensorFlow needed)"),
    ("t5_stdlib_seq2seq", "wmt14_translate/de-en", "hf:wmt/wmt14:de-en (no TensorFlow needed)"),
    ("vit_b16_tpu_v5e_1", "imagenet2012",
     "hf:DIR (ImageNet as parquet files with image and label columns)"),
])
def test_text_refusals_name_the_hf_alternative(tmp_path, experiment, dataset, alternative):
    empty = tmp_path / "tfds"
    code, _, lines = cli_here("train", "--experiment", experiment, "--workdir", tmp_path / "w",
                              "--set", f"dataset={dataset}", "--set", f"data_dir={empty}",
                              "--set", "eval_split=validation")
    base = dataset.split("/")[0]
    assert code == 2 and lines == [
        f"error: dataset {dataset!r} is not prepared in {empty}, and TFDS needs TensorFlow (not "
        f"installed) to find or prepare it: use dataset={alternative}, or "
        f"run `tfds build {dataset} --file_format=array_record` where TensorFlow is installed "
        f"and copy its {base}/ folder into {empty} (or set data_dir=gs://BUCKET/DIR); see "
        "docs/datasets.md"]
    assert not (tmp_path / "w").exists()


def test_lm_task_reads_the_text_key(tmp_path):
    """The LM task's text_key option: an hf corpus whose documents are in ``content``."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    ds = datasets.Dataset.from_dict({"content": TEXTS[:40], "url": ["u"] * 40})
    spec = write_splits(tmp_path / "web", {"train": ds, "validation": ds}, "parquet")
    cfg = apply_overrides(load_experiment("stdlib_gpt"), [
        f"dataset={spec}", "task.text_key=content", "seq_len=16", "batch_size=4",
        f"data_dir={tmp_path / 'd'}"])
    batch = next(iter(make_task(cfg, tmp_path / "run").make_iterator("validation", 0, 1,
                                                                      train=False)))
    listed = next(iter(data.make_lm_iterator(TEXTS[:40], "validation", tokenizer="byte",
                                             seq_len=16, batch_size=4, shuffle=False,
                                             repeat=False)))
    np.testing.assert_array_equal(batch["inputs"], listed["inputs"])


@pytest.fixture
def spm_texts(monkeypatch):
    """The texts each SentencePiece training gets (the real training still runs)."""
    calls = []
    train = data.train_sentencepiece

    def spy(texts, *args, **kwargs):
        calls.append(list(texts))
        return train(texts, *args, **kwargs)

    monkeypatch.setattr(data, "train_sentencepiece", spy)
    return calls


PAIRS = [("a fine film", "it was great"), ("dull and long", "too slow"), ("loved it", "yes")]


@pytest.mark.parametrize("pair", [False, True], ids=["sentence", "sentence1+sentence2"])
def test_classify_sentencepiece_trains_on_the_task_fields(tmp_path, spm_texts, pair):
    """glue/sst2 (``sentence``) and a sentence-pair set (``text_b_key``): SentencePiece
    trains on the fields the examples are read from, not on a missing ``text``."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    a, b = [p[0] for p in PAIRS] * 4, [p[1] for p in PAIRS] * 4
    columns = ({"sentence1": a, "sentence2": b} if pair else {"sentence": a})
    ds = datasets.Dataset.from_dict({**columns, "label": [0, 1, 1] * 4})
    spec = write_splits(tmp_path / "glue", {"train": ds, "validation": ds}, "parquet")
    keys = ["task.text_key=sentence1", "task.text_b_key=sentence2"] if pair else []
    cfg = apply_overrides(load_experiment("bert_classify_stdlib"), [
        f"dataset={spec}", "eval_split=validation", "batch_size=2", "seq_len=24",
        "tokenizer=sentencepiece", "sentencepiece_vocab_size=300", "task.num_classes=2",
        f"data_dir={tmp_path / 'd'}", *keys])
    task = make_task(cfg, tmp_path / "run")
    assert spm_texts == [a + b if pair else a]
    assert task.tokenizer_spec == f"sentencepiece:{tmp_path / 'run' / 'spm.model'}"
    tok = task.vocab.tokenizer
    enc = task.encoded("validation")
    n = len(tok.encode(a[0]))
    assert enc["input_ids"][0, 0] == task.vocab.cls_id
    assert tok.decode(enc["input_ids"][0, 1:1 + n].tolist()) == a[0]


@pytest.mark.parametrize("experiment", ["bert_mlm_stdlib", "bert_pretrain_stdlib"])
def test_bert_pretraining_reads_the_text_key(tmp_path, spm_texts, experiment):
    """mlm and pretrain: ``task.text_key`` names the documents' field, for the batches and
    for SentencePiece; the batches equal those of the same documents in ``text``."""
    from transformer_jax.tasks import make_task
    from transformer_jax.train.config import apply_overrides, load_experiment

    docs = [t + "\n" + t.upper() for t in TEXTS[:40]]   # pretrain pairs lines of a document

    def first_batch(column, tokenizer, run):
        ds = datasets.Dataset.from_dict({column: docs})
        spec = write_splits(tmp_path / f"{run}_{column}", {"train": ds, "validation": ds}, "parquet")
        cfg = apply_overrides(load_experiment(experiment), [
            f"dataset={spec}", f"task.text_key={column}", "seq_len=16", "batch_size=4",
            f"tokenizer={tokenizer}", "sentencepiece_vocab_size=300",
            f"data_dir={tmp_path / 'd'}"])
        task = make_task(cfg, tmp_path / run)
        return next(iter(task.make_iterator("validation", 0, 1, train=False)))

    first_batch("content", "sentencepiece", "spm")
    assert spm_texts == [docs]
    ours, theirs = first_batch("content", "byte", "a"), first_batch("text", "byte", "b")
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key])


# ----------------------------------------------------------------------------- TPU experiments

EXPERIMENTS_DIR = Path(__file__).resolve().parents[2] / "experiments"
TPU_EXPERIMENTS = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*tpu*.py"))
WIKITEXT, WIKITEXT_CONFIG = "Salesforce/wikitext", "wikitext-103-raw-v1"


def _wiki_rows(split: str, articles: int) -> list[str]:
    """WikiText raw rows: one line each, empty rows between, headings in `` = ... = ``."""
    rows = []
    for a in range(articles):
        rows += ["", f" = {split.title()} article {a} = \n", "",
                 f" The {split} article {a} was written in {1990 + a} , and it lists "
                 f"{3 * a + 1} @-@ item examples . \n",
                 f" = = Section {a} = = \n", "",
                 f" Its section {a} holds {a % 4 + 2} short paragraphs of plain text . \n"]
    return rows


@pytest.fixture(scope="module")
def wikitext_copy(tmp_path_factory):
    """A local copy laid out like the Hub repository Salesforce/wikitext:
    ``wikitext/<config>/{train,validation,test}-00000-of-00001.parquet``, a ``text`` column."""
    root = tmp_path_factory.mktemp("hub") / "wikitext"
    (root / WIKITEXT_CONFIG).mkdir(parents=True)
    rows = {"train": _wiki_rows("train", 8), "validation": _wiki_rows("validation", 3),
            "test": _wiki_rows("test", 2)}
    for split, texts in rows.items():
        datasets.Dataset.from_dict({"text": texts}).to_parquet(
            str(root / WIKITEXT_CONFIG / f"{split}-00000-of-00001.parquet"))
    return root, rows


IMAGENET_CLASSES = 1000
IMAGENET_SIZES = [(50, 37), (37, 50), (64, 64), (40, 71), (33, 45), (80, 60), (47, 47),
                  (52, 39), (36, 58), (61, 44)]


@pytest.fixture(scope="module")
def imagenet_copy(tmp_path_factory):
    """ImageNet as parquet files (``data/{train,validation}-*.parquet``): JPEG ``image``
    (varied sizes) and a 1000-class ``label``, unique per image. Returns the root and, per
    split, the decoded images and labels."""
    rng = np.random.default_rng(2)
    root = tmp_path_factory.mktemp("hub") / "imagenet"
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(
        names=[f"n{i:08d}" for i in range(IMAGENET_CLASSES)])})
    splits, out = {}, {}
    for split, (first, n) in {"train": (0, 10), "validation": (10, 8)}.items():
        jpegs, decoded, labels = [], [], []
        for i in range(first, first + n):
            h, w = IMAGENET_SIZES[i % len(IMAGENET_SIZES)]
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
            jpegs.append({"bytes": buf.getvalue(), "path": None})
            decoded.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
            labels.append((97 * i + 13) % IMAGENET_CLASSES)
        splits[split] = datasets.Dataset.from_dict({"image": jpegs, "label": labels},
                                                   features=features)
        out[split] = (decoded, labels)
    write_splits(root, splits, "parquet")
    return root, out


def _close(it) -> None:
    """Stops a train iterator's background thread and its image workers, if any."""
    it.close()
    inner = getattr(it, "iterator", None)
    if inner is not None and hasattr(inner, "close"):
        inner.close()


def _first_batches(cfg, tmp_path):
    """The task a run of ``cfg`` in ``tmp_path/run`` builds, and its first train and eval
    batches, from the iterators ``run.setup`` and ``evaluate`` use."""
    from transformer_jax.tasks import make_task

    task = make_task(cfg, tmp_path / "run")
    train = task.train_iterator(0, 1)
    try:
        first_train = next(train)
    finally:
        _close(train)
    return task, first_train, next(iter(task.eval_batches(0, 1)))


def _docs_first_batches(cfg, tmp_path):
    """An experiment over in-memory documents (the Llama fine-tuning ones: finetune_stdlib's
    slice): windows of them, in its byte tokenizer (``--init-from`` brings the checkpoint's)."""
    from transformer_jax.train.config import apply_overrides, load_experiment

    assert cfg.dataset == load_experiment("finetune_stdlib").dataset
    assert (cfg.task, cfg.tokenizer) == ("lm", "byte")
    b = math.lcm(4, cfg.accum_steps)
    local = apply_overrides(cfg, ["seq_len=24", f"batch_size={b}", "model.max_len=24",
                                  f"data_dir={tmp_path / 'data'}"])
    task, first_train, first_eval = _first_batches(local, tmp_path)
    tok, eos = task.tokenizer, task.eos_id
    stream = "\x1e".join(cfg.dataset) + "\x1e"
    for batch in (first_train, first_eval):
        assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
            "inputs": ((b, 24), "int32"), "targets": ((b, 24), "int32"),
            "weights": ((b, 24), "float32")}
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for row in batch["inputs"]:
            cuts = [-1, *np.flatnonzero(row == eos), len(row)]
            text = "\x1e".join(tok.decode(row[a + 1:z].tolist()) for a, z in zip(cuts, cuts[1:]))
            assert len(text) == 24 - (len(cuts) - 2) and text in stream, text


def _lm_first_batches(cfg, tmp_path, wikitext_copy):
    from transformer_jax.train.config import apply_overrides

    root, rows = wikitext_copy
    prefix = f"hf:{WIKITEXT}:"
    assert cfg.dataset == prefix + WIKITEXT_CONFIG and cfg.eval_split == "validation"
    assert (cfg.task, cfg.tokenizer) == ("lm", "sentencepiece")
    b = math.lcm(4, cfg.accum_steps)
    local = apply_overrides(cfg, [f"dataset={cfg.dataset.replace(prefix, f'hf:{root}:')}",
                                  "seq_len=24", f"batch_size={b}", "sentencepiece_vocab_size=300",
                                  f"data_dir={tmp_path / 'data'}"])
    task, first_train, first_eval = _first_batches(local, tmp_path)   # trains spm.model first
    assert task.tokenizer_spec == f"sentencepiece:{tmp_path / 'run' / 'spm.model'}"
    tok, eos = task.tokenizer, task.eos_id

    def text(ids) -> str:   # eos shown as \x1e
        cuts = [-1, *np.flatnonzero(ids == eos), len(ids)]
        return "\x1e".join(tok.decode(ids[a + 1:z].tolist()) for a, z in zip(cuts, cuts[1:]))

    for split, batch in (("train", first_train), ("validation", first_eval)):
        assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
            "inputs": ((b, 24), "int32"), "targets": ((b, 24), "int32"),
            "weights": ((b, 24), "float32")}
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        # the split's non-empty rows, each ended by eos; every row is a stretch of them
        stream = "\x1e".join(t for t in rows[split] if t) + "\x1e"
        for row in batch["inputs"]:
            assert len(text(row)) >= 24 and text(row) in stream, (split, text(row))
    # eval reads the validation split in order: its first batch is the split's start
    start = text(first_eval["inputs"].reshape(-1))
    assert start.count("\x1e") >= 1 and stream.startswith(start), start
    np.testing.assert_array_equal(first_eval["weights"], np.ones((b, 24), np.float32))


def _vit_first_batches(cfg, tmp_path, imagenet_copy):
    from transformer_jax.train.config import apply_overrides

    root, splits = imagenet_copy
    assert (cfg.dataset, cfg.eval_split, cfg.task) == (
        "imagenet2012", "validation", "image_classification")
    b = math.lcm(4, cfg.accum_steps)   # 8 for the v5e-1's accum_steps=8
    local = apply_overrides(cfg, [f"dataset=hf:{root}", f"batch_size={b}",
                                  f"data_dir={tmp_path / 'data'}"])
    task, first_train, first_eval = _first_batches(local, tmp_path)
    assert (task.info.num_classes, task.info.num_channels, task.image_size) == (
        IMAGENET_CLASSES, 3, 224)
    params = {"seed": local.seed, "image_size": 224, "max_value": 255.0, "augment": True,
              "flip": task.info.flip, "num_channels": 3, "name": local.dataset}
    for split, batch in (("train", first_train), ("validation", first_eval)):
        images, labels = batch["images"], batch["labels"]
        assert (images.shape, images.dtype.name, labels.dtype.name) == (
            (b, 224, 224, 3), "float32", "int32")
        assert -1.0 <= images.min() < images.max() <= 1.0
        np.testing.assert_array_equal(batch["weights"], np.ones(b, np.float32))
        decoded, all_labels = splits[split]
        ids = [all_labels.index(int(label)) for label in labels]   # labels are unique
        if split == "validation":   # in order, no augmentation
            assert ids == list(range(b))
            expected = [image_data.preprocess_image(decoded[i], 224) for i in ids]
        else:   # shuffled, augmented as the experiment asks (task.augment)
            assert len(set(ids)) == b
            expected = [image_data.prepare_row({"image": decoded[i]}, i, 0, params) for i in ids]
        np.testing.assert_allclose(images, np.stack(expected), atol=1e-5)


@pytest.mark.parametrize("name", TPU_EXPERIMENTS)
def test_tpu_experiment_data_runs_on_a_local_copy(name, tmp_path, wikitext_copy, imagenet_copy):
    """Every TPU experiment's data path, without TensorFlow, on a local copy of its dataset
    in the real format (the Hub repository's parquet files; ImageNet as ``hf:DIR`` parquet,
    docs/datasets.md): the run's train and eval iterators, shrunk to a small batch."""
    from transformer_jax.train.config import load_experiment

    assert len(TPU_EXPERIMENTS) >= 7
    cfg = load_experiment(name)
    if isinstance(cfg.dataset, list):
        _docs_first_batches(cfg, tmp_path)
    elif cfg.dataset.startswith(f"hf:{WIKITEXT}:"):
        _lm_first_batches(cfg, tmp_path, wikitext_copy)
    elif cfg.dataset == "imagenet2012":
        _vit_first_batches(cfg, tmp_path, imagenet_copy)
    else:
        pytest.fail(f"{name}: no local copy of its dataset {cfg.dataset!r}; add one to this test")
