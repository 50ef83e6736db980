"""Fine-tuning runs: ``--init-from`` an HF directory or a workdir for every family and task
(what loads, what starts fresh, what is recorded), adapters that train over a frozen base
(LoRA: the base unchanged to the bit, optimizer state for the adapters alone), and
``export`` back to an HF directory that ``AutoModel*.from_pretrained`` loads strictly and
that reproduces our logits within 1e-5 (fp32)."""
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

peft = pytest.importorskip("peft")

from tests.helpers import tiny_cfg
from tests.interop.conftest import bert_model, gpt2_model, t5_model, torch, transformers, vit_model
from tests.tokenizer_dirs import LLAMA_STYLE, gpt2_dir, llama_style_dir
from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf
from transformer_jax.layers import lora as lora_lib
from transformer_jax.layers.lora import LoraConfig
from transformer_jax.train import finetune
from transformer_jax.train.config import apply_overrides
from transformer_jax.export import export
from transformer_jax.workdir import load_run
from transformer_jax.run import setup, train
from transformer_jax.train.step import full_params

EXPORT_ATOL = 1e-5
# Byte tokens (259 ids; BERT appends [CLS]/[SEP]/[MASK]): the tiny HF models have room.
VOCAB = 300
SHORT = ["steps=2", "log_every=1", "eval_every=2", "save_every=2", "eval_batches=1",
         "sample_tokens=0", "batch_size=4", "seq_len=32"]


def flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random HF models, saved as save_pretrained directories (no tokenizer files)."""
    root = tmp_path_factory.mktemp("hf")
    models = {
        "gpt2": gpt2_model(vocab_size=VOCAB, n_positions=64),
        "bert-mlm": bert_model("mlm", vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0),
        "t5": t5_model(vocab_size=VOCAB),
        "vit": vit_model(num_channels=1, image_size=16, num_labels=5),
    }
    dirs = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def task_cfg(data_dir, kind: str, init_from: str | None, *extra: str):
    """A short run of ``kind`` (lm, mlm, classify, seq2seq, image) from ``init_from``."""
    tasks = {"lm": ["task=lm", "model=gpt"], "mlm": ["task=mlm", "model=bert"],
             "classify": ["task=classify", "model=bert"],
             "seq2seq": ["task=seq2seq", "model=t5", "eval_split=validation"],
             "image": ["task=image_classification", "model=vit", "dataset=digits",
                       "eval_split=test"]}
    cfg = tiny_cfg(data_dir)
    cfg = apply_overrides(cfg.replace(model_overrides={}), tasks[kind] + SHORT + list(extra))
    return cfg.replace(init_from=init_from)


# ----------------------------------------------------------------------------- init-from

LR = 1e-4      # one AdamW step moves each parameter by about LR: loaded ones stay within it


def _hf_logits(model, kind, rng):
    """(our inputs, HF logits) for a random batch of ``kind``."""
    if kind == "image":
        images = rng.uniform(-1, 1, (2, 16, 16, 1)).astype(np.float32)
        with torch.no_grad():
            return (jnp.asarray(images),), model(torch.tensor(images).permute(0, 3, 1, 2)).logits.numpy()
    if kind == "seq2seq":
        src, tgt = rng.integers(3, 259, (2, 7)), rng.integers(3, 259, (2, 5))
        with torch.no_grad():
            out = model(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(tgt))
        return (jnp.asarray(src), jnp.asarray(tgt)), out.logits.numpy()
    ids = rng.integers(3, 259, (2, 9))
    with torch.no_grad():
        return (jnp.asarray(ids),), model(torch.tensor(ids)).logits.numpy()


def _ours(workdir, inputs):
    _, model, params, _ = load_run(workdir)
    return np.asarray(model.apply({"params": params}, *inputs))


# ----------------------------------------------------------------------------- special ids

def _special_ids(out) -> tuple[dict, dict | None]:
    """(config.json's bos/eos/pad ids, generation_config.json's ids or None) of an export."""
    config = json.loads((Path(out) / "config.json").read_text())
    path = Path(out) / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else None
    if generation is not None:
        generation.pop("transformers_version")
    return {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, generation


GEN_TOKENS = 12


def _doubled_row(params, row: int, source: int):
    """Our params with the read-out row of token ``row`` twice that of ``source``."""
    params = jax.tree_util.tree_map(np.array, params)
    if "lm_head" in params:
        kernel = params["lm_head"]["kernel"]                        # (D, V)
        kernel[:, row] = 2 * kernel[:, source]
    else:                                                           # tied: the embedding
        table = params["wte"]["embedding"]                          # (V, D)
        table[row] = 2 * table[source]
    return params


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy ``model.generate`` from ``prompt`` (its generation_config)."""
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=GEN_TOKENS,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()


def _assert_generates_alike(run, out, prompt: list[int], eos: int) -> list[int]:
    """Greedy generation from ``prompt`` with our ``generate`` (the run's task: where it
    stops) and with transformers' ``model.generate`` on the export ``out`` (its
    generation_config.json: where it stops) gives the same tokens, ending at ``eos`` after at
    most 4 new ones. Random weights seldom emit an eos, so in both models the read-out row
    of ``eos`` is made twice that of the 4th token emitted without it: ``eos``'s logit, twice
    that token's, wins at that step if not before, and no earlier step changes."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    free = _hf_greedy(hf, prompt)
    assert len(free) == len(prompt) + GEN_TOKENS and eos not in free[len(prompt):]
    source = free[len(prompt) + 3]
    with torch.no_grad():
        weight = hf.get_output_embeddings().weight                  # (V, D)
        weight[eos] = 2 * weight[source]
    theirs = _hf_greedy(hf, prompt)
    _, model, params, task = load_run(run)
    ours = task.generate_ids(model, _doubled_row(params, eos, source), prompt,
                             max_new_tokens=GEN_TOKENS, temperature=0.0)
    new = len(ours) - len(prompt)
    assert ours == theirs == free[:len(ours) - 1] + [eos] and 1 <= new <= 4, (ours, theirs)
    return ours


@pytest.mark.parametrize("kind,source,fresh,auto", [
    ("lm", "gpt2", set(), "AutoModelForCausalLM"),
    # a classifier from an MLM checkpoint: HF's MLM model has no pooler either
    ("classify", "bert-mlm", {"bert/pooler", "classifier"}, "AutoModelForSequenceClassification"),
    ("seq2seq", "t5", set(), "AutoModelForSeq2SeqLM"),
    # 5 classes there, 10 here; LoRA: the new head trains with the adapters
    ("image", "vit", {"head"}, "AutoModelForImageClassification"),
])
def test_init_from_hf_then_export(data_dir, hf_dirs, tmp_path, capsys, kind, source, fresh, auto):
    """One training step from an HF directory: every shared weight came from it (within the
    one step's reach; untouched under LoRA), the others are the task's fresh head, the start
    is recorded; then the export loads strictly into ``AutoModel*`` and reproduces our
    logits (ViT with LoRA: merged, and as a PEFT adapter that carries the new head)."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    lora = ["lora.rank=4"] if kind == "image" else []
    train(task_cfg(data_dir, kind, hf_dirs[source], "steps=1", f"learning_rate={LR}",
                   "schedule=constant", "warmup_steps=0", *lora), run_dir)
    said = capsys.readouterr().out
    _, _, trained, _ = load_run(run_dir)
    _, pretrained = from_hf(hf_dirs[source])
    ours, theirs = flat(trained), flat(jax.tree_util.tree_map(np.asarray, pretrained))
    loaded = {p for p in ours if p in theirs and ours[p].shape == theirs[p].shape}
    moved = max(float(np.abs(np.asarray(ours[p]) - theirs[p]).max()) for p in loaded)
    assert (moved == 0) if lora else (0 < moved <= 1.5 * LR)
    assert {"/".join(p[:-1]) for p in ours if p not in loaded and p[-1] not in ("lora_a", "lora_b")} == fresh
    record = json.loads((run_dir / "config.json").read_text())["init_from"]
    assert record["path"] == hf_dirs[source] and record["kind"] == "hf"
    assert record["sha256"] == finetune.load_source(hf_dirs[source]).digest()
    assert {f.rsplit("/", 1)[0] for f in record["fresh"]} == fresh
    assert f"init-from {hf_dirs[source]} (hf, " in said
    assert ("initialised fresh" in said) == bool(fresh)

    summary = export(str(run_dir), str(out), merge=bool(lora))
    assert {"model.safetensors", "config.json"} <= set(summary["files"])
    model, info = getattr(transformers, auto).from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    inputs, theirs_logits = _hf_logits(model.eval(), kind, np.random.default_rng(0))
    np.testing.assert_allclose(_ours(run_dir, inputs), theirs_logits, rtol=0, atol=EXPORT_ATOL)
    if lora:                      # the adapter and the trained head, over the HF base
        export(str(run_dir), str(tmp_path / "peft"), fmt="peft")
        adapted = peft.PeftModel.from_pretrained(getattr(transformers, auto).from_pretrained(
            hf_dirs[source], num_labels=10, ignore_mismatched_sizes=True), tmp_path / "peft")
        inputs, theirs_logits = _hf_logits(adapted.eval(), kind, np.random.default_rng(0))
        np.testing.assert_allclose(_ours(run_dir, inputs), theirs_logits, rtol=0,
                                   atol=EXPORT_ATOL)
    if kind != "image":           # the byte tokenizer's files: the same ids, no </s> added
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        _, _, _, task = load_run(run_dir)
        text = "def f(x):\n    return 'é'"
        ids = (task.vocab.tokenizer if hasattr(task, "vocab") else task.tokenizer).encode(text)
        assert tokenizer(text)["input_ids"] == ids
    # the byte tokenizer's special ids (no bos, eos 1, pad 0), not the HF classes' defaults
    # (GPT-2's 50256, T5's); a generating model's generation_config.json holds them too
    config_ids, generation = _special_ids(out)
    want = {"lm": {"eos_token_id": 1, "pad_token_id": 0},
            "seq2seq": {"eos_token_id": 1, "pad_token_id": 0, "decoder_start_token_id": 0}}
    assert generation == want.get(kind)
    if kind == "lm":
        assert config_ids == {"bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
        _assert_generates_alike(run_dir, out, ids, eos=1)


def test_init_from_takes_the_checkpoints_model_and_reports_what_does_not_apply(
        data_dir, hf_dirs, tmp_path, capsys):
    cfg = task_cfg(data_dir, "lm", hf_dirs["gpt2"], "model.num_layers=4", "model.d_model=128",
                   "model.dropout_rate=0.2")
    run = setup(cfg, tmp_path / "run")
    run.ckpt.close()
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (model["num_layers"], model["d_model"], model["vocab_size"]) == (2, 64, VOCAB)
    assert model["dropout_rate"] == 0.2                     # training may change dropout
    err = capsys.readouterr().err
    assert "num_layers=4 (checkpoint: 2)" in err and "d_model=128 (checkpoint: 64)" in err
    assert "dropout_rate" not in err


@pytest.mark.parametrize("where,message", [
    ("missing", "is not a directory"),
    ("empty", "has no config.json"),
])
def test_init_from_errors(data_dir, tmp_path, where, message):
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    with pytest.raises(UserError, match=message):
        setup(task_cfg(data_dir, "lm", str(path)), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- adapters

def test_a_lora_run_trains_the_adapters_alone_and_exports_merged(data_dir, hf_dirs, tmp_path):
    """LoRA rank 4 on every attention and MLP projection of the HF GPT-2, 3 steps: the
    optimizer state covers the adapters alone, the base is unchanged to the bit; the export
    needs --merge (or --format peft) and reproduces our logits; and a new run started from
    this workdir gets its merged weights."""
    cfg = task_cfg(data_dir, "lm", hf_dirs["gpt2"], "lora.rank=4", "lora.alpha=8",
                   "lora.targets=attn/|mlp/", "steps=3", "learning_rate=1e-2")
    workdir = tmp_path / "run"
    probe = setup(cfg, tmp_path / "probe")
    probe.ckpt.close()
    start = jax.tree_util.tree_map(np.asarray, probe.state)
    train(cfg, workdir, progress=False)

    trainable = flat(start.params)
    assert trainable and {p[-1] for p in trainable} == {"lora_a", "lora_b"}
    moments = [x for x in jax.tree_util.tree_leaves(start.opt_state) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in trainable.values())  # Adam
    run_config, _, params, _ = load_run(workdir)
    after = flat(params)
    for path, value in flat(start.frozen).items():
        np.testing.assert_array_equal(np.asarray(after[path]), value, err_msg="/".join(path))
    assert all(np.abs(np.asarray(after[p])).max() > 0 for p in trainable if p[-1] == "lora_b")

    with pytest.raises(UserError, match="--format peft, or the merged model with --format hf --merge"):
        export(str(workdir), str(tmp_path / "plain"))
    assert not (tmp_path / "plain").exists()
    export(str(workdir), str(tmp_path / "merged"), merge=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    inputs, theirs = _hf_logits(model.eval(), "lm", np.random.default_rng(1))
    np.testing.assert_allclose(_ours(workdir, inputs), theirs, rtol=0, atol=EXPORT_ATOL)
    with pytest.raises(UserError, match="not an empty directory"):
        export(str(workdir), str(tmp_path / "merged"), merge=True)
    summary = export(str(workdir), str(tmp_path / "peft"), fmt="peft")   # the adapter alone
    assert summary["files"] == ["adapter_config.json", "adapter_model.safetensors",
                                "tokenizer.json", "tokenizer_config.json"]   # no base weights
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["gpt2"]), tmp_path / "peft")
    inputs, theirs = _hf_logits(peft_model.eval(), "lm", np.random.default_rng(2))
    np.testing.assert_allclose(_ours(workdir, inputs), theirs, rtol=0, atol=EXPORT_ATOL)

    merged = lora_lib.merge(params, LoraConfig.from_value(run_config["model"]["lora"]))
    run = setup(task_cfg(data_dir, "lm", str(workdir), "model.scan_layers=True"), tmp_path / "ft")
    run.ckpt.close()
    ours = full_params(run.state)
    assert run.state.frozen is None                      # no adapters now: everything trains
    assert not any(p[-1] in ("lora_a", "lora_b") for p in flat(ours))
    np.testing.assert_array_equal(ours["h"]["mlp"]["wi"]["kernel"][1],       # scanned now
                                  merged["h_1"]["mlp"]["wi"]["kernel"])
    np.testing.assert_array_equal(ours["wte"]["embedding"], params["wte"]["embedding"])


# ----------------------------------------------------------------------------- the CLI

def test_cli_init_from_with_the_checkpoints_tokenizer_then_export(data_dir, tmp_path, here):
    """``train --init-from`` an HF GPT-2 directory with its own BPE tokenizer (LoRA, and a
    ``model.num_layers`` that does not apply: one warning naming it alone), then
    ``export --merge``: the run tokenizes with ``hf:DIR`` (the ids AutoTokenizer gives), the
    export carries the tokenizer files, and AutoModel/AutoTokenizer reproduce our logits on
    the same text. The CLI's ``main`` runs in this process (nothing here needs a process of
    its own; tests/helpers.py ``cli_here``)."""
    hf_dir = tmp_path / "hf"
    gpt2_dir(hf_dir)                                   # tokenizer (701 ids) + a config
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    gpt2_model(vocab_size=len(tokenizer), n_positions=64).save_pretrained(hf_dir)
    run, out = tmp_path / "run", tmp_path / "out"
    code, stdout, lines = here("train", "--init-from", str(hf_dir), "--workdir", str(run),
                               "--no-progress", *(f"--set={o}" for o in SHORT),
                               f"--set=data_dir={data_dir}", "--set=lora.rank=4",
                               "--set=learning_rate=1e-2", "--set=schedule=constant",
                               "--set=model.num_layers=3")
    assert code == 0, lines
    # the setting given here is named; the default experiment's own (num_layers=4,
    # d_model=128, max_len=256: for training from scratch) are not
    assert lines == [f"warning: --init-from {hf_dir}: the model is the checkpoint's (gpt); the "
                     "model settings num_layers=3 (checkpoint: 2) do not apply"]
    arrays = len(flat(from_hf(hf_dir)[1]))               # every one of them
    assert f"init-from {hf_dir} (hf, gpt): {arrays} parameter arrays loaded\n" in stdout
    saved = json.loads((run / "config.json").read_text())
    assert saved["experiment"]["tokenizer"] == f"hf:{hf_dir}"
    assert saved["model"]["vocab_size"] == len(tokenizer) and saved["model"]["lora"]["rank"] == 4
    umask = os.umask(0o022)
    try:
        code, stdout, lines = here("export", "--workdir", str(run), "--out", str(out), "--merge")
    finally:
        os.umask(umask)
    assert code == 0 and lines == [], lines
    # what others may read, as mkdir/open give it under umask 022 (not mkdtemp's 0o700, nor
    # the 0o600 safetensors writes)
    assert {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]} == {
        "out": 0o755, **{name: 0o644 for name in json.loads(stdout)["files"]}}
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors",
            "config.json"} <= set(json.loads(stdout)["files"])
    exported = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1\n"
    ids = exported(text)["input_ids"]
    _, _, _, task = load_run(run)
    assert ids == tokenizer(text)["input_ids"] == task.tokenizer.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(_ours(run, (jnp.asarray([ids]),)), theirs, rtol=0, atol=EXPORT_ATOL)
    # <|endoftext|> (700) is bos, eos and pad (the checkpoint's config names GPT2Config's
    # 50256, outside the 701 ids: not taken); both generate to it
    eot = {"bos_token_id": 700, "eos_token_id": 700, "pad_token_id": 700}
    assert _special_ids(out) == (eot, eot)
    _assert_generates_alike(run, out, ids, eos=700)
    code, _, lines = here("train", "--workdir", str(run), "--resume", "--no-progress",   # one step more
                          *(f"--set={o}" for o in SHORT), f"--set=data_dir={data_dir}",
                          "--set=learning_rate=1e-2", "--set=schedule=constant", "--steps=3")
    assert code == 0 and lines == [], lines        # no --init-from, no lora.*: from config.json
    assert json.loads((run / "config.json").read_text())["init_from"] == saved["init_from"]
    assert (run / "checkpoints" / "3").is_dir()
    code, _, lines = here("export", "--workdir", str(run), "--out", str(tmp_path / "x"))
    assert code == 2 and lines == ["error: this run trained LoRA adapters: export them with "
                                   "--format peft, or the merged model with --format hf --merge"]


#: the Llama 3 directory's second eos (its tokenizer has no spare special token: a piece)
SECOND_EOS = 599


@pytest.mark.parametrize("family", sorted(LLAMA_STYLE))
def test_cli_init_from_a_llama_style_dir_with_its_tokenizer_then_export(family, data_dir,
                                                                        tmp_path, here):
    """``train --init-from`` a Llama 3 (llama3 RoPE scaling over 16 positions), Qwen 2.5
    (q/k/v biases) or Qwen 3 (q/k norms, head size != D / N) directory with its own
    tokenizer.json, 2 steps on 32 tokens, then ``export`` (``--format hf``): the run keeps the
    family's settings and tokenizes as AutoTokenizer does, the export is the same HF class
    with the same RoPE parameters, and it reproduces our logits on 40 tokens."""
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
    llama_style_dir(hf_dir, family, max_len=64)
    if family == "llama3":   # two eos ids, as Llama 3 Instruct's <|end_of_text|>, <|eot_id|>
        transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, SECOND_EOS]).save_pretrained(hf_dir)
    source = transformers.AutoConfig.from_pretrained(hf_dir)
    code, _, lines = here("train", "--init-from", str(hf_dir), "--workdir", str(run),
                          "--no-progress", *(f"--set={o}" for o in SHORT),
                          f"--set=data_dir={data_dir}", "--set=learning_rate=1e-2",
                          "--set=schedule=constant")
    assert code == 0 and not [line for line in lines if line.startswith("error:")], lines
    saved = json.loads((run / "config.json").read_text())
    assert saved["experiment"]["tokenizer"] == f"hf:{hf_dir}"
    model_cfg = saved["model"]
    assert (model_cfg["qkv_bias"], model_cfg["qk_norm"]) == (family == "qwen2", family == "qwen3")
    assert (model_cfg["rope_scaling"] or {}).get("kind") == ("llama3" if family == "llama3" else None)
    code, stdout, lines = here("export", "--workdir", str(run), "--out", str(out),
                               "--format", "hf")
    assert code == 0 and lines == [], lines
    assert {"tokenizer.json", "model.safetensors", "config.json"} <= set(json.loads(stdout)["files"])
    exported = transformers.AutoConfig.from_pretrained(out)
    assert exported.model_type == source.model_type
    assert exported.rope_parameters == source.rope_parameters
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return [x + 1 for _ in range(3)]  # " * 2
    ids = tokenizer(text)["input_ids"][:40]
    _, _, _, task = load_run(run)
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert len(ids) == 40 and ids == original(text)["input_ids"][:40]
    # the run's tokenizer adds no bos (Llama's tokenizer.json does; Qwen's adds none)
    unspecial = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert task.tokenizer.encode(text) == unspecial and (ids[0] == 1) == (family == "llama3")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == f"{LLAMA_STYLE[family][0]}ForCausalLM"
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(_ours(run, (jnp.asarray([ids]),)), theirs, rtol=0, atol=EXPORT_ATOL)
    # the checkpoint's generation ids (Llama: <s> 1, </s> 2 and the second eos, pad = eos as
    # the run pads; Qwen: <|endoftext|> 600, no bos); both generate to the (second) eos
    want = ({"bos_token_id": 1, "eos_token_id": [2, SECOND_EOS], "pad_token_id": 2}
            if family == "llama3" else {"bos_token_id": None, "eos_token_id": 600,
                                        "pad_token_id": 600})
    assert _special_ids(out) == (want, {k: v for k, v in want.items() if v is not None})
    _assert_generates_alike(run, out, ids[:20], eos=SECOND_EOS if family == "llama3" else 600)


def test_cli_init_from_a_gemma_dir_with_its_tokenizer_then_export(data_dir, tmp_path, here):
    """Gemma 3 (its own family): ``train --init-from`` a Gemma3ForCausalLM directory with its
    own BPE tokenizer (LoRA), ``export --format peft`` (PEFT loads it over the base) and
    ``export --format hf --merge`` (AutoModel loads a Gemma3ForCausalLM): both reproduce our
    logits, the tokenizer our ids."""
    from tests.interop.test_hf_gemma import gemma_model

    hf_dir = tmp_path / "hf"
    gpt2_dir(hf_dir)                                   # tokenizer (701 ids) + a config
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    # the checkpoint names its tokenizer's ids (not Gemma3TextConfig's defaults 2, 1, 0)
    settings = dict(vocab_size=len(tokenizer), bos_token_id=700, eos_token_id=700,
                    pad_token_id=None)
    base = gemma_model(**settings)
    base.save_pretrained(hf_dir)
    run = tmp_path / "run"
    code, stdout, lines = here("train", "--init-from", str(hf_dir), "--workdir", str(run),
                               "--no-progress", *(f"--set={o}" for o in SHORT),
                               f"--set=data_dir={data_dir}", "--set=lora.rank=4",
                               "--set=lora.targets=attn/(query|key|value|out)|mlp/wo",
                               "--set=learning_rate=1e-2", "--set=schedule=constant")
    assert code == 0, lines
    arrays = len(flat(from_hf(hf_dir)[1]))
    assert f"init-from {hf_dir} (hf, gemma): {arrays} parameter arrays loaded\n" in stdout
    saved = json.loads((run / "config.json").read_text())
    assert (saved["family"], saved["experiment"]["tokenizer"]) == ("gemma", f"hf:{hf_dir}")
    text = "def f(x):\n    return x + 1\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == load_run(run)[3].tokenizer.encode(text)
    ours = _ours(run, (jnp.asarray([ids]),))
    for fmt in ("peft", "hf"):
        out = tmp_path / f"export_{fmt}"
        code, _, lines = here("export", "--workdir", str(run), "--out", str(out),
                              "--format", fmt, *(["--merge"] if fmt == "hf" else []))
        assert code == 0 and lines == [], lines
        if fmt == "peft":
            model = peft.PeftModel.from_pretrained(gemma_model(**settings), str(out)).eval()
        else:
            assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ids
            model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
            assert type(model) is transformers.Gemma3ForCausalLM
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=EXPORT_ATOL)
    eot = {"bos_token_id": 700, "eos_token_id": 700, "pad_token_id": 700}
    assert _special_ids(out) == (eot, eot)
    _assert_generates_alike(run, out, ids, eos=700)


def test_qlora_on_llama_trains_over_an_nf4_base_and_exports_merged(data_dir, tmp_path):
    """QLoRA on a Llama (RoPE, RMSNorm, SwiGLU, 2 kv heads of 4): the frozen block kernels
    are stored NF4 (4-bit codes, absmax per 64 values), the adapters train, and the merged
    export (base read back + adapters folded in) reproduces our logits in HF's Llama."""
    hf_dir = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf_dir)
    cfg = task_cfg(data_dir, "lm", str(hf_dir), "lora.rank=4", "lora.targets=attn/|mlp/",
                   "lora.quantize=nf4", "steps=3", "learning_rate=1e-2")
    train(cfg, tmp_path / "run", progress=False)
    _, model, params, _ = load_run(tmp_path / "run")
    stored = flat(params)
    query = ("h_0", "self_attn", "query")
    assert ("kernel" not in params["h_0"]["self_attn"]["query"]
            and stored[query + ("kernel_q",)].dtype == np.uint8
            and stored[query + ("kernel_q",)].size == 64 * 64 // 2)      # two codes a byte
    assert stored[("lm_head", "kernel")].dtype == np.float32             # the head stays fp32
    assert np.abs(np.asarray(stored[query + ("lora_b",)])).max() > 0
    export(str(tmp_path / "run"), str(tmp_path / "out"), merge=True)
    # the byte tokenizer's ids, not LlamaConfig's defaults (bos 1, eos 2)
    assert _special_ids(tmp_path / "out") == (
        {"bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0},
        {"eos_token_id": 1, "pad_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    inputs, theirs = _hf_logits(hf, "lm", np.random.default_rng(3))
    np.testing.assert_allclose(_ours(tmp_path / "run", inputs), theirs, rtol=0, atol=EXPORT_ATOL)


def test_prefix_tuning_run_exports_a_peft_prefix(data_dir, hf_dirs, tmp_path):
    """Prefix tuning (8 learned keys/values per layer) over the HF GPT-2: only the prefix
    trains, and its PEFT export over the HF base reproduces our logits."""
    cfg = task_cfg(data_dir, "lm", hf_dirs["gpt2"], "model.prefix_tokens=8", "steps=2",
                   "learning_rate=1e-2")
    probe = setup(cfg, tmp_path / "probe")
    probe.ckpt.close()
    assert {p[-1] for p in flat(probe.state.params)} == {"prefix_key", "prefix_value"}
    train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(UserError, match="export it with --format peft"):
        export(str(tmp_path / "run"), str(tmp_path / "hf"))
    export(str(tmp_path / "run"), str(tmp_path / "out"), fmt="peft")
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["gpt2"]), tmp_path / "out")
    inputs, theirs = _hf_logits(model.eval(), "lm", np.random.default_rng(4))
    np.testing.assert_allclose(_ours(tmp_path / "run", inputs), theirs, rtol=0, atol=EXPORT_ATOL)


def test_init_from_a_bf16_directory_streams_in_the_runs_param_dtype(data_dir, tmp_path,
                                                                    monkeypatch):
    """A bf16 checkpoint under a bf16 run: every tensor is streamed onto the devices as
    bf16 (never widened to fp32), and the run starts from exactly those values."""
    from transformer_jax.interop.hf import stream

    directory = str(tmp_path / "bf16")
    gpt2_model(vocab_size=VOCAB, n_positions=64).to(torch.bfloat16).save_pretrained(directory)
    placed = []
    real_put = stream.put
    monkeypatch.setattr(stream, "put", lambda x, s: placed.append(x.dtype) or real_put(x, s))
    run = setup(task_cfg(data_dir, "lm", directory, "model.param_dtype=bfloat16"), tmp_path / "run")
    assert len(placed) == 36 and set(placed) == {np.dtype(jnp.bfloat16)}   # a put a leaf
    _, old = from_hf(directory)                             # fp32 from bf16: exact
    assert len(flat(old)) == 36
    params = flat(full_params(run.state))
    for path, want in flat(old).items():
        got = np.asarray(params[path])
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape, path
        assert got.tobytes() == np.asarray(want).astype(jnp.bfloat16).tobytes(), path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama directory (2 layers, 2 kv heads of 4), bf16 weights."""
    directory = tmp_path_factory.mktemp("llama") / "bf16"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).to(
        torch.bfloat16).save_pretrained(directory)
    return str(directory)


def _leaves(tree):
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("quantize,scan", [("int8", False), ("nf4", True)])
def test_a_qlora_start_puts_the_streamed_stored_base_in_the_state(data_dir, llama_dir, tmp_path,
                                                                  monkeypatch, quantize, scan):
    """QLoRA --init-from an HF directory streams the base stored quantized into
    TrainState.frozen, and initialises only what trains: the whole state (frozen base,
    adapters, optimizer state, keys) and the first step's loss equal, bit for bit, those of
    the path that builds the whole tree (fresh init, the base filled in, then quantized)."""
    from transformer_jax.interop.hf import stream
    from transformer_jax.layers.quant import quantize_params

    cfg = task_cfg(data_dir, "lm", llama_dir, "lora.rank=4", "lora.targets=attn/|mlp/",
                   f"lora.quantize={quantize}", f"model.scan_layers={scan}",
                   "model.param_dtype=bfloat16", "learning_rate=1e-2")
    placed = []
    real_put = stream.put
    monkeypatch.setattr(stream, "put", lambda x, s: placed.append(x.dtype) or real_put(x, s))
    new = setup(cfg, tmp_path / "new")
    new.ckpt.close()
    # the stored kernels are what was streamed: 7 kernels a layer, int8 codes or nf4 bytes
    codes = np.dtype(np.int8 if quantize == "int8" else np.uint8)
    assert placed.count(codes) == 7 * (1 if scan else 2)
    want_frozen = _leaves(quantize_params(from_hf(llama_dir, param_dtype="bfloat16",
                                                  scan_layers=scan)[1],
                                          LoraConfig(quantize=quantize)))
    got_frozen = _leaves(new.state.frozen)
    assert sorted(got_frozen) == sorted(want_frozen)
    for key, want in want_frozen.items():
        assert got_frozen[key].dtype == want.dtype and got_frozen[key].tobytes() == want.tobytes(), key

    _assert_same_start_as_the_whole_tree_way(cfg, new, tmp_path, monkeypatch, fresh=[])


def _assert_same_start_as_the_whole_tree_way(cfg, new, tmp_path, monkeypatch, fresh):
    """``new`` (a QLoRA start's Run) against the way that built the whole tree (the base
    streamed unquantized, a fresh init, the base filled in, then quantized): the same
    state bit for bit, and the same loss after one step on the same batch."""
    from transformer_jax import run as run_module

    source_placement = run_module._source_placement
    monkeypatch.setattr(run_module, "_source_placement", lambda c: {
        k: v for k, v in source_placement(c).items() if k not in ("quantize", "scan_layers")})
    old = setup(cfg, tmp_path / "old")
    old.ckpt.close()
    assert old.run_config["init_from"]["fresh"] == new.run_config["init_from"]["fresh"] == fresh
    got, want = _leaves(new.state), _leaves(old.state)
    assert sorted(got) == sorted(want) and any("lora_a" in k for k in got)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key
    losses = [float(run.train_step(run.state, next(run.batches))[1]["loss"]) for run in (new, old)]
    assert losses[0] == losses[1] and np.isfinite(losses[0])


def test_a_qlora_start_with_a_fresh_head_equals_the_whole_tree_way(data_dir, hf_dirs, tmp_path,
                                                                  monkeypatch):
    """ViT (converted whole, then stored int8): its head (5 classes there, 10 here) starts
    fresh and trains with the adapters, as it did before."""
    cfg = task_cfg(data_dir, "image", hf_dirs["vit"], "lora.rank=4", "lora.targets=attn/|mlp/",
                   "lora.quantize=int8")
    new = setup(cfg, tmp_path / "new")
    new.ckpt.close()
    assert {"/".join(p) for p in flat(new.state.params)} >= {"head/kernel", "head/bias"}
    assert any(p[-1] == "kernel_q" for p in flat(new.state.frozen))
    _assert_same_start_as_the_whole_tree_way(cfg, new, tmp_path, monkeypatch,
                                             fresh=["head/bias", "head/kernel"])


def test_peak_host_memory_of_a_qlora_start_stays_below_the_bf16_base(tmp_path):
    """The real QLoRA --init-from start (run.setup, in a subprocess: NF4 base, rank-8 LoRA on
    every projection, bf16, AdamW) of a 99M-parameter bf16 Llama directory. On the CPU
    backend the devices are host memory, so the start's peak RSS growth is the state (the
    NF4 base, the adapters and their two AdamW moments: 71 MiB here) plus what is in flight:
    one tensor read, cast and quantized, and the compile of the adapters' init. The bound
    is the bf16 base itself (188 MiB): the way that built the whole base first held it
    (and its float32 init) on top of the state. XLA's compiles of each kernel shape are
    warmed by a one-layer start of the same widths (benchmarks/load_memory.py)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.load_memory import measure, write_checkpoint
    from transformer_jax.models import GPTConfig

    # 8 layers, D 1024, 16 heads (4 kv), F 2816, vocab 4096 untied: 98.6M parameters
    cfg = GPTConfig.preset("llama-tiny").replace(
        vocab_size=4096, d_model=1024, num_heads=16, num_kv_heads=4, mlp_dim=2816,
        num_layers=8, tie_embeddings=False)
    total = write_checkpoint(tmp_path / "ckpt", cfg, shard_bytes=64 << 20)
    assert total == 2 * cfg.num_params() == 197_167_104
    out = measure(tmp_path / "ckpt", "qlora-start")
    # the frozen base: 90.2M kernel values as 4-bit codes + an fp32 absmax per 64, and the
    # embeddings, head and norms in bf16
    kernels = 8 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816)
    assert out["state_bytes"]["frozen"] == kernels // 2 + kernels // 64 * 4 + 2 * (
        2 * 4096 * 1024 + 17 * 1024) == 67_536_896
    assert out["state_bytes"]["opt_state"] >= 2 * out["state_bytes"]["params"]   # AdamW mu, nu
    assert out["peak_rss_growth"] < total, out
