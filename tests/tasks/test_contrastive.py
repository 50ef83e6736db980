"""The contrastive task: CLIP's loss against Hugging Face's and PyTorch's, the caption
batches, the zero-shot classifier and retrieval metrics, and a short training run.

The loss over a mesh and under pmap equals one device's in ``tests/test_sharding.py``
(the ``clip`` cases of the parity worker).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import get_tokenizer
from transformer_jax.errors import UserError
from transformer_jax.tasks import contrastive as C
from transformer_jax.tasks import make_task
from transformer_jax.train.config import ExperimentConfig, apply_overrides

torch = pytest.importorskip("torch")


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def embeddings(b=6, e=8, seed=0):
    rng = np.random.default_rng(seed)
    return (unit(rng.standard_normal((b, e))).astype(np.float32),
            unit(rng.standard_normal((b, e))).astype(np.float32))


def test_loss_equals_hugging_face_clip_loss():
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss as clip_loss

    img, txt = embeddings()
    scale = 14.3
    loss_sum, sums = C.symmetric_contrastive_loss(jnp.asarray(img), jnp.asarray(txt), scale)
    logits_per_text = torch.from_numpy(scale * txt.astype(np.float64) @ img.T.astype(np.float64))
    want = float(clip_loss(logits_per_text))
    assert float(sums["weight"]) == 6
    np.testing.assert_allclose(float(loss_sum) / 6, want, rtol=1e-6)
    np.testing.assert_allclose(float(sums["nll"]) / 6, want, rtol=1e-6)
    hits = np.argmax(img @ txt.T, axis=1) == np.arange(6)
    assert float(sums["correct"]) == hits.sum()


def test_a_caption_of_the_same_class_is_a_hit_but_changes_no_loss():
    img, txt = embeddings(b=4, seed=4)
    txt[1] = txt[0]                             # two images of one class, the same caption
    img[1] = txt[0]                             # image 1 is nearest to caption 0 (and 1)
    args = (jnp.asarray(img), jnp.asarray(txt), 10.0)
    plain_loss, plain = C.symmetric_contrastive_loss(*args)
    loss, sums = C.symmetric_contrastive_loss(*args, labels=jnp.asarray([7, 7, -1, 3]))
    assert float(loss) == float(plain_loss)
    best = np.argmax(img @ txt.T, axis=1)
    assert best[1] == 0
    want = np.sum(best == np.arange(4)) + 1     # row 1 found a caption of its class
    assert float(sums["correct"]) == want == float(plain["correct"]) + 1


def test_label_smoothing_as_torch_cross_entropy_both_ways():
    img, txt = embeddings(b=5, seed=1)
    scale, s = 9.0, 0.1
    loss_sum, sums = C.symmetric_contrastive_loss(jnp.asarray(img), jnp.asarray(txt), scale,
                                                  smoothing=s)
    logits = torch.from_numpy(scale * img.astype(np.float64) @ txt.T.astype(np.float64))
    target = torch.arange(5)
    ce = torch.nn.functional.cross_entropy
    want = 0.5 * (ce(logits, target, label_smoothing=s) + ce(logits.T, target, label_smoothing=s))
    plain = 0.5 * (ce(logits, target) + ce(logits.T, target))
    np.testing.assert_allclose(float(loss_sum) / 5, float(want), rtol=1e-6)
    np.testing.assert_allclose(float(sums["nll"]) / 5, float(plain), rtol=1e-6)


def test_padding_rows_are_neither_queries_nor_negatives():
    img, txt = embeddings(b=7, seed=2)
    w = np.array([1, 1, 1, 1, 1, 0, 0], np.float32)
    garbage_img, garbage_txt = img.copy(), txt.copy()
    garbage_img[5:] = img[0]                   # a padding row that would be a perfect negative
    garbage_txt[5:] = np.nan                   # or poison the sums
    got, sums = C.symmetric_contrastive_loss(jnp.asarray(garbage_img), jnp.asarray(garbage_txt),
                                             5.0, jnp.asarray(w))
    want, want_sums = C.symmetric_contrastive_loss(jnp.asarray(img[:5]), jnp.asarray(txt[:5]), 5.0)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert float(sums["weight"]) == 5 and float(sums["correct"]) == float(want_sums["correct"])
    grads = jax.grad(lambda a: C.symmetric_contrastive_loss(a, jnp.asarray(txt), 5.0,
                                                            jnp.asarray(w))[0])(jnp.asarray(img))
    assert np.all(np.isfinite(grads)) and np.all(np.asarray(grads)[5:] == 0)


def test_gathered_rows_under_pmap_equal_the_whole_batch():
    """One device here: pmap over 1 device gathers a 1-way axis, the rows are the batch."""
    img, txt = embeddings(b=4, seed=3)
    f = jax.pmap(lambda a, b: C.symmetric_contrastive_loss(a, b, 3.0, axis_name="i")[0],
                 axis_name="i")
    got = f(jnp.asarray(img)[None], jnp.asarray(txt)[None])
    want = C.symmetric_contrastive_loss(jnp.asarray(img), jnp.asarray(txt), 3.0)[0]
    np.testing.assert_allclose(float(got[0]), float(want), rtol=1e-6)


def test_captions_end_with_the_end_of_text_and_are_cut_keeping_it():
    tok = get_tokenizer("byte")
    enc = C.encode_captions(tok, ["a photo of the digit seven.", "ab"], seq_len=8)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids.shape == (2, 8) and ids.dtype == np.int32
    assert list(ids[0]) == tok.encode("a photo")[:7] + [tok.eos_id]
    assert list(ids[1]) == tok.encode("ab") + [tok.eos_id] + [tok.pad_id] * 5
    assert mask.tolist() == [[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]
    with pytest.raises(UserError, match="no room"):
        C.encode_captions(tok, ["x"], seq_len=1)


def test_recall_at_1_by_index_and_by_label():
    sim = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.1], [0.0, 0.1, 0.7]])
    assert C.recall_at_1(sim) == pytest.approx(2 / 3)          # row 1 picks column 0
    assert C.recall_at_1(sim, np.array([4, 4, 2])) == 1.0      # ... a caption of its class


def test_class_embeddings_are_normalised_template_means():
    tok = get_tokenizer("byte")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, 5)).astype(np.float32)

    def encode_text(ids, mask):            # a bag of tokens, enough to tell texts apart
        return (table[ids] * mask[..., None]).sum(axis=1)

    names, templates = ("cat", "dog"), ("a {}.", "the {} here")
    got = C.class_embeddings(encode_text, tok, names, templates, seq_len=16)
    for k, name in enumerate(names):
        enc = C.encode_captions(tok, [t.format(name) for t in templates], 16)
        want = unit(unit(encode_text(enc["input_ids"], enc["attention_mask"])).mean(axis=0))
        np.testing.assert_allclose(got[k], want, rtol=1e-5)


# ----------------------------------------------------------------------------- the task

SETS = ["task=contrastive", "model=clip", "model_preset=tiny", "dataset=digits",
        "eval_split=test", "seq_len=40", "model.max_len=40", "batch_size=16", "steps=4", "schedule=constant",
        "learning_rate=1e-3", "warmup_steps=1", "log_every=1", "eval_every=4", "save_every=4",
        "eval_batches=2", "task.eval_images=40"]


def task_for(tmp_path, *extra):
    return make_task(apply_overrides(ExperimentConfig(model_overrides={}), SETS + list(extra)), tmp_path)


def test_digit_batches_carry_template_captions_and_resume(tmp_path):
    task = task_for(tmp_path)
    tok = task.tokenizer
    it = task.train_iterator(0, 1)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    later = [next(it) for _ in range(2)]
    b = first[0]
    assert b["images"].shape == (16, 16, 16, 1) and b["input_ids"].shape == (16, 40)
    captions = [tok.decode(row) for row in b["input_ids"]]
    for caption, label in zip(captions, b["labels"]):
        assert any(caption == t.format(C.DIGIT_NAMES[label]) for t in C.DIGIT_TEMPLATES), caption
    assert len(set(c.split(" ")[0] for c in captions)) > 1          # templates vary
    again = task.train_iterator(0, 1)
    again.set_state(state)
    for want, got in zip(later, [next(again) for _ in range(2)]):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])
    # eval: one in-order pass, template index mod M, padding rows weigh nothing
    ev = list(task.eval_batches(0, 1))
    assert sum(float(x["weights"].sum()) for x in ev) == 359
    first_eval = tok.decode(ev[0]["input_ids"][1])
    assert first_eval == C.DIGIT_TEMPLATES[1].format(C.DIGIT_NAMES[ev[0]["labels"][1]])


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="accum_steps=1"):
        task_for(tmp_path, "accum_steps=2")
    with pytest.raises(UserError, match="set model=clip"):
        make_task(apply_overrides(ExperimentConfig(model_overrides={}),
                                  ["task=contrastive", "model=vit", "dataset=digits"]), tmp_path)
    for templates in ("['no slot']", "['a {x}']", "['{0} {}']", "['a {} {}']"):
        with pytest.raises(UserError, match="one '\\{\\}' each"):
            task_for(tmp_path, f"task.templates={templates}")
    for bad in ("0", "-3", "2.5"):
        with pytest.raises(UserError, match=f"task.eval_images={bad} must be an integer >= 1"):
            task_for(tmp_path, f"task.eval_images={bad}")
    with pytest.raises(ValueError, match="max_len=16; lower seq_len"):
        task_for(tmp_path, "model.max_len=16")
    with pytest.raises(UserError, match="'a blurry photo of the number three.' takes 36 tokens"):
        task_for(tmp_path, "seq_len=30")


def test_caption_datasets_pick_a_caption_per_epoch(tmp_path):
    task = task_for(tmp_path)
    task.caption_key = "captions/text"          # coco_captions' layout
    example = {"image": np.zeros((4, 4, 3), np.uint8),
               "captions": {"text": np.array([b"a cat.", b"two dogs.", b"a bird."], dtype=object)}}
    train = {task.caption(example, 5, epoch, train=True) for epoch in range(12)}
    assert train == {"a cat.", "two dogs.", "a bird."}
    assert task.caption(example, 5, 0, train=False) == "a cat."
    with pytest.raises(UserError, match="task.caption_key"):
        task.caption({"image": None, "caption": b"x"}, 0, 0, train=True)


def test_train_logs_zero_shot_and_retrieval(tmp_path):
    from transformer_jax.run import train
    from transformer_jax.train.monitor import read_metrics

    cfg = apply_overrides(ExperimentConfig(model_overrides={}), SETS)
    train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    evals = [r for r in rows if "eval_zero_shot_accuracy" in r]
    assert evals and evals[-1]["step"] == 4
    last = evals[-1]
    assert [k for k in last if "ppl" in k] == []   # a contrastive loss has no perplexity
    for key in ("eval_zero_shot_accuracy", "eval_i2t_recall_at_1", "eval_t2i_recall_at_1"):
        assert 0.0 <= last[key] <= 1.0
    # 40 held-out images: every figure is a whole number of fortieths
    assert abs(last["eval_zero_shot_accuracy"] * 40 - round(last["eval_zero_shot_accuracy"] * 40)) < 1e-9
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))
    # in-batch image -> text accuracy: hits out of 16 pairs
    assert all(abs(r["accuracy"] * 16 - round(r["accuracy"] * 16)) < 1e-5 for r in rows if "loss" in r)
    spec = json.loads((tmp_path / "run" / "config.json").read_text())
    assert spec["family"] == "clip"


def test_init_from_a_clip_directory_with_its_tokenizer_then_export(tmp_path, here):
    """An HF CLIPModel directory with tokenizer files: the run takes its weights and its
    tokenizer (``hf:DIR``), trains, and ``export --format hf`` gives a CLIPModel with the
    JAX logits. (The tokenizer is a small byte-level BPE: a CLIP BPE cannot be built offline.)
    ``train`` and ``export`` are the CLI's ``main`` in this process (tests/helpers.py
    ``cli_here``: nothing here needs a process of its own)."""
    import transformers

    from tests.tokenizer_dirs import gpt2_dir
    from transformer_jax.workdir import load_run

    src, run, out = tmp_path / "clip", tmp_path / "run", tmp_path / "export"
    gpt2_dir(src)                                  # the tokenizer (its config.json is replaced)
    eos = transformers.AutoTokenizer.from_pretrained(src).eos_token_id
    text = dict(vocab_size=eos + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=48, eos_token_id=eos,
                bos_token_id=eos, pad_token_id=eos)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=4, num_channels=1)
    torch.manual_seed(0)
    transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                   projection_dim=16)).save_pretrained(src)
    sets = ["batch_size=16", "log_every=1", "eval_every=2", "save_every=2", "eval_batches=1",
            "warmup_steps=1", "task.eval_images=32"]
    code, _, lines = here("train", "--experiment", "clip_digits", "--workdir", str(run),
                          "--init-from", str(src), "--steps", "2",
                          *[a for s in sets for a in ("--set", s)])
    assert code == 0, lines
    saved = json.loads((run / "config.json").read_text())
    assert saved["task_spec"]["tokenizer"] == f"hf:{src}"
    assert saved["model"]["vocab_size"] == eos + 1 and saved["model"]["eos_token_id"] == eos
    _, model, params, task = load_run(run)
    batch = next(iter(task.eval_batches(0, 1)))
    # captions in the checkpoint's tokenizer, ending with its end of text
    first = batch["input_ids"][0][batch["attention_mask"][0] > 0]
    assert first[-1] == eos and task.tokenizer.decode(first).startswith("a photo of the digit")

    code, _, lines = here("export", "--workdir", str(run), "--out", str(out), "--format", "hf")
    assert code == 0, lines
    hf = transformers.CLIPModel.from_pretrained(out).eval()
    with jax.default_matmul_precision("highest"):
        ours = model.apply({"params": params}, batch["input_ids"][:6], batch["images"][:6],
                           batch["attention_mask"][:6])
    with torch.no_grad():
        theirs = hf(input_ids=torch.from_numpy(batch["input_ids"][:6]).long(),
                    pixel_values=torch.from_numpy(batch["images"][:6].transpose(0, 3, 1, 2)),
                    attention_mask=torch.from_numpy(batch["attention_mask"][:6]).long())
    np.testing.assert_allclose(np.asarray(ours["logits_per_image"]),
                               theirs.logits_per_image.numpy(), atol=1e-4)
