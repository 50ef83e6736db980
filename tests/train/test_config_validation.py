"""``ExperimentConfig`` validates every field when it is made: types, ranges, the relations
between fields, and the model settings as far as they are known before the task (the
family, its preset, each ``model.FIELD``). A mistake is one ``error:`` line from the CLI,
exit status 2, naming the field, the value and what is allowed, before the run writes
anything.

As in tests/models/test_config_validation.py, the numeric fields come from
``dataclasses.fields`` and :data:`ALLOWED` says which probes (zero, a negative, a float where
an int belongs, a string) each accepts; a numeric field missing from it fails the test.
"""
import ast
from pathlib import Path

import pytest

from transformer_jax.cli import main as cli_main
from transformer_jax.errors import UserError
from transformer_jax.models.base import RelationError
from transformer_jax import run as run_module
from transformer_jax.train import optim
from transformer_jax.train.config import (TASK_MODEL_FIELDS, ExperimentConfig, LogConfig,
                                          apply_overrides, named_model_fields)

from tests.helpers import numeric_fields, probes

ALLOWED: dict[str, set] = {
    "sentencepiece_vocab_size": set(), "seq_len": set(), "batch_size": set(), "steps": set(),
    "accum_steps": set(), "learning_rate": set(), "warmup_steps": {"zero"},
    "end_learning_rate": {"zero"}, "b1": {"zero"}, "b2": {"zero"}, "eps": set(),
    "weight_decay": {"zero"}, "clip_norm": set(), "label_smoothing": {"zero"}, "seed": {"zero"},
    "loss_chunk": {"zero"},
    "loss_scale_init": set(), "loss_scale_growth_interval": set(), "log_every": set(),
    "eval_every": set(), "eval_batches": set(), "save_every": set(), "keep": set(),
    "loss_spike_factor": set(), "loss_spike_window": set(), "sample_tokens": {"zero"},
    "data_workers": {"zero"},
}


def numeric_cases():
    for name, is_int in numeric_fields(ExperimentConfig).items():
        for probe, value in probes(is_int).items():
            yield pytest.param(name, probe, value, id=f"{name}={value!r}")


def test_every_numeric_field_is_classified():
    assert set(numeric_fields(ExperimentConfig)) == set(ALLOWED)


@pytest.mark.parametrize("name, probe, value", list(numeric_cases()))
def test_numeric_probe(name, probe, value):
    if probe in ALLOWED[name]:
        assert getattr(ExperimentConfig(**{name: value}), name) == value
        return
    with pytest.raises(UserError) as info:
        ExperimentConfig(**{name: value})
    message = str(info.value)
    assert f"ExperimentConfig.{name}" in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize("changes, message", [
    # the reported bug: a negative learning rate trained to the end
    (dict(learning_rate=-1e-3), "ExperimentConfig.learning_rate must be a number > 0 (the peak; "
                                "noam: its scale factor), got -0.001"),
    (dict(learning_rate=0), "ExperimentConfig.learning_rate must be a number > 0 (the peak; noam: "
                            "its scale factor), got 0"),
    (dict(learning_rate=float("nan")), "ExperimentConfig.learning_rate must be a finite number > 0 "
                                       "(the peak; noam: its scale factor), got nan"),
    (dict(steps=0), "ExperimentConfig.steps must be an integer >= 1, got 0"),
    (dict(steps=10.0), "ExperimentConfig.steps must be an integer >= 1, got 10.0"),
    (dict(keep=True), "ExperimentConfig.keep must be an integer >= 1, got True"),
    (dict(warmup_steps=-1), "ExperimentConfig.warmup_steps must be an integer >= 0, got -1"),
    (dict(b1=1.0), "ExperimentConfig.b1 must be a number in [0, 1), got 1.0"),
    (dict(b2="0.99"), "ExperimentConfig.b2 must be a number in [0, 1), got '0.99'"),
    (dict(eps=0), "ExperimentConfig.eps must be a number > 0, got 0"),
    (dict(clip_norm=0.0), "ExperimentConfig.clip_norm must be a number > 0 or None (None: no "
                          "clipping), got 0.0"),
    (dict(label_smoothing=1.5), "ExperimentConfig.label_smoothing must be a number in [0, 1], got 1.5"),
    (dict(seed=2 ** 63), "ExperimentConfig.seed must be an integer in [0, 9223372036854775807], "
                         "got 9223372036854775808"),
    (dict(sentencepiece_vocab_size=256), "ExperimentConfig.sentencepiece_vocab_size must be an "
                                         "integer >= 300 (256 byte pieces + specials), got 256"),
    (dict(loss_scale_init=0), "ExperimentConfig.loss_scale_init=0 must be > 0 (e.g. 2**15)"),
    (dict(loss_scale_init="big"), "ExperimentConfig.loss_scale_init must be a number, got 'big'"),
    (dict(loss_spike_factor=0.5), "ExperimentConfig.loss_spike_factor must be a number >= 1 or "
                                  "None (None: no spike detection), got 0.5"),
    (dict(sample_tokens=-1), "ExperimentConfig.sample_tokens must be an integer >= 0 (0: no "
                             "samples), got -1"),
    (dict(eval_batches=0), "ExperimentConfig.eval_batches must be an integer >= 1, got 0"),
])
def test_field_messages(changes, message):
    with pytest.raises(UserError) as info:
        ExperimentConfig(**changes)
    assert str(info.value) == message


@pytest.mark.parametrize("changes, message", [
    (dict(name=""), "ExperimentConfig.name must be a non-empty string, got ''"),
    (dict(task=None), "ExperimentConfig.task must be a non-empty string, got None"),
    (dict(dataset=3), "ExperimentConfig.dataset must be a dataset name (a non-empty string) or "
                      "a non-empty list/tuple of in-memory documents, got 3"),
    (dict(dataset=()), "ExperimentConfig.dataset must be a dataset name (a non-empty string) or "
                       "a non-empty list/tuple of in-memory documents, got ()"),
    (dict(data_dir=""), "ExperimentConfig.data_dir must be a non-empty string or None, got ''"),
    (dict(sample_prompt=None), "ExperimentConfig.sample_prompt must be a string, got None"),
    (dict(task_options=[("a", 1)]), "ExperimentConfig.task_options must be a dict whose keys are "
                                    "names (str), got [('a', 1)]"),
    (dict(model_overrides={1: 2}), "ExperimentConfig.model_overrides must be a dict whose keys "
                                   "are names (str), got {1: 2}"),
    (dict(model="gpt3"), "ExperimentConfig.model='gpt3' is unknown; choose one of ['bert', 'clip', "
                         "'gemma', 'gpt', 't5', 'transformer', 'vit']"),
    (dict(schedule="cosine"), "ExperimentConfig.schedule='cosine' is unknown; choose one of "
                              "['constant', 'noam', 'warmup_cosine', 'warmup_rsqrt', 'warmup_times_cosine']"),
    (dict(parallelism="pjit"), "ExperimentConfig.parallelism must be 'jit' or 'pmap', got 'pjit'"),
    (dict(loss_scale=1), "loss_scale=1 is unknown; choose 'auto' (dynamic for "
                         "model.dtype=float16), 'dynamic' or 'none'"),
    (dict(tokenizer="wordpiece"), "ExperimentConfig.tokenizer='wordpiece' is unknown; use 'byte', "
                                  "'sentencepiece' (trained into the workdir), 'sentencepiece:PATH' "
                                  "or the path of a SentencePiece .model file"),
    (dict(tokenizer="sentencepiece:"), "ExperimentConfig.tokenizer='sentencepiece:' is unknown; "
                                       "use 'byte', 'sentencepiece' (trained into the workdir), "
                                       "'sentencepiece:PATH' or the path of a SentencePiece "
                                       ".model file"),
])
def test_other_fields(changes, message):
    with pytest.raises(UserError) as info:
        ExperimentConfig(**changes)
    assert str(info.value) == message


def test_allowed_values():
    assert ExperimentConfig(dataset=("ab", "cd")).dataset == ("ab", "cd")   # in-memory documents
    for tok in ("byte", "bytes", "byt5", "sentencepiece", "sentencepiece:/x/spm.model",
                "spm:gs://b/spm.model", "/x/spm.model"):
        assert ExperimentConfig(tokenizer=tok).tokenizer == tok
    cfg = ExperimentConfig(learning_rate=1, clip_norm=None, loss_spike_factor=None, sample_prompt="",
                           data_dir="/data", seed=2 ** 63 - 1, label_smoothing=1.0, b1=0, b2=0.0)
    assert (cfg.learning_rate, cfg.clip_norm, cfg.seed) == (1, None, 2 ** 63 - 1)


# ----------------------------------------------------------------------------- relations

@pytest.mark.parametrize("changes, message, fields", [
    (dict(batch_size=30, accum_steps=4),
     "ExperimentConfig.batch_size=30 is not divisible by accum_steps=4; choose a batch_size that "
     "is a multiple of it", ("batch_size", "accum_steps")),
    (dict(schedule="noam", warmup_steps=0),
     "ExperimentConfig.warmup_steps=0 must be >= 1 for schedule='noam' (its decay is relative "
     "to the end of the warm-up)", ("warmup_steps", "schedule")),
    (dict(schedule="warmup_rsqrt", warmup_steps=0),
     "ExperimentConfig.warmup_steps=0 must be >= 1 for schedule='warmup_rsqrt' (its decay is "
     "relative to the end of the warm-up)", ("warmup_steps", "schedule")),
    (dict(learning_rate=1e-3, end_learning_rate=2e-3),
     "ExperimentConfig.end_learning_rate=0.002 must be <= learning_rate=0.001 (the cosine decays "
     "from learning_rate to end_learning_rate)", ("end_learning_rate", "learning_rate")),
    (dict(seq_len=512),
     "ExperimentConfig.seq_len=512 exceeds the model's max_len=256; lower seq_len or set "
     "model.max_len>=512", ("seq_len",)),
])
def test_relations(changes, message, fields):
    with pytest.raises(RelationError) as info:
        ExperimentConfig(**changes)
    assert str(info.value) == message
    assert info.value.fields == fields


def test_warmup_against_steps():
    """A warm-up longer than the run is fine where the schedule allows it; warmup_cosine's
    warmup_steps < steps is checked when the run builds its schedule (optim.warmup_cosine)."""
    for schedule in ("constant", "warmup_rsqrt", "noam"):
        cfg = ExperimentConfig(schedule=schedule, steps=10, warmup_steps=100)
        optim.make_schedule(cfg.schedule, **cfg.schedule_kwargs(64))
    cfg = ExperimentConfig(steps=10, warmup_steps=50)      # made, then fixed by replace
    assert cfg.replace(warmup_steps=2).warmup_steps == 2
    with pytest.raises(UserError, match=r"warmup_cosine needs total_steps > warmup_steps, got "
                                        r"total_steps=10, warmup_steps=50"):
        optim.make_schedule(cfg.schedule, **cfg.schedule_kwargs(64))
    # the end rate only matters to warmup_cosine
    assert ExperimentConfig(schedule="constant", end_learning_rate=1.0).end_learning_rate == 1.0


def test_every_schedule_has_its_arguments():
    for name in optim.SCHEDULES:
        cfg = ExperimentConfig(schedule=name)
        assert float(optim.make_schedule(name, **cfg.schedule_kwargs(64))(60)) > 0


# ----------------------------------------------------------------------------- the model

@pytest.mark.parametrize("changes, message", [
    (dict(model_overrides=dict(num_layers=0)), "GPTConfig.num_layers must be an integer >= 1, got 0"),
    (dict(model_overrides=dict(num_layers="abc")),
     "GPTConfig.num_layers must be an integer >= 1, got 'abc'"),
    (dict(model_overrides=dict(num_layers=1.5)), "GPTConfig.num_layers must be an integer >= 1, got 1.5"),
    (dict(model_overrides=dict(num_heads=3)), "GPTConfig.d_model=64 is not divisible by num_heads=3"),
    (dict(model_preset="gpt5"), "unknown GPTConfig preset 'gpt5'; choose one of ['gpt2', "
                                "'gpt2-large', 'gpt2-medium', 'gpt2-xl', 'llama-2-7b', "
                                "'llama-3.1-8b', 'llama-3.2-1b', 'llama-3.2-3b', 'llama-tiny', "
                                "'mistral-7b', 'mistral-tiny', 'qwen2.5-0.5b', 'qwen2.5-1.5b', "
                                "'qwen2.5-tiny', 'qwen3-0.6b', 'qwen3-1.7b', 'qwen3-tiny', "
                                "'tiny', 'tinyllama-1.1b']. Did you mean 'gpt2'?"),
    (dict(model="t5", model_overrides=dict(vocab_size=600, eos_token_id=600)),
     "T5Config.eos_token_id=600 is outside the vocabulary [0, 600) (vocab_size)"),
    (dict(model="vit", model_overrides=dict(image_size=16, patch_size=5)),
     "ViTConfig.image_size=16 is not a multiple of patch_size=5; pick sizes whose patches tile "
     "the image"),
    (dict(model="bert", model_overrides=dict(dropout_rate=-0.1)),
     "BertConfig.dropout_rate must be in [0, 1), got -0.1"),
])
def test_model_mistakes_are_refused_with_the_experiment(changes, message):
    with pytest.raises(UserError) as info:
        ExperimentConfig(**changes)
    assert str(info.value) == message


def test_relations_on_fields_the_task_fixes_wait_for_the_task():
    """vocab_size and image_size come from the task's data unless model.FIELD sets them: a
    relation on them is checked when the run builds the model."""
    cfg = ExperimentConfig(model="t5", model_overrides=dict(eos_token_id=600))
    assert cfg.model_overrides == {"eos_token_id": 600}
    cfg = ExperimentConfig(model="vit", model_overrides=dict(patch_size=5))
    assert cfg.model_overrides == {"patch_size": 5}
    # names the family lacks (the GPT defaults under model=t5) are left to the run
    assert ExperimentConfig(task="seq2seq", model="t5").model == "t5"


def test_task_model_fields_cover_every_task():
    """Every key a task's model_overrides() returns is in TASK_MODEL_FIELDS (read from the
    source: the tasks need their data to run)."""
    tasks = Path(__file__).resolve().parents[2] / "transformer_jax" / "tasks"
    found = set()
    for path in tasks.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "model_overrides":
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Dict):
                        found |= {k.value for k in sub.keys if isinstance(k, ast.Constant)}
                    if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant):
                        found.add(sub.slice.value)
    assert {"vocab_size", "num_classes", "image_size"} <= found
    assert found <= TASK_MODEL_FIELDS


# ----------------------------------------------------------------------------- overrides

@pytest.mark.parametrize("override, message", [
    ("model.num_layers=0", "GPTConfig.num_layers must be an integer >= 1, got 0"),
    ("model.num_layers=abc", "GPTConfig.num_layers must be an integer >= 1, got 'abc'"),
    ("model.num_layers=1.5", "GPTConfig.num_layers must be an integer >= 1, got 1.5"),
    ("model.num_layers=true", "GPTConfig.num_layers must be an integer >= 1, got True"),
    ("model.dropout_rate=1e999", "GPTConfig.dropout_rate must be in [0, 1), got inf"),
    ("learning_rate=-1e-3", "ExperimentConfig.learning_rate must be a number > 0 (the peak; noam: "
                            "its scale factor), got -0.001"),
    ("seed=1.5", "seed=1.5 must be of type int (e.g. --set seed=0)"),
    ("clip_norm=abc", "clip_norm='abc' must be of type float | None (e.g. --set clip_norm=1.0)"),
])
def test_apply_overrides(override, message):
    with pytest.raises(UserError) as info:
        apply_overrides(ExperimentConfig(), [override])
    assert str(info.value) == message


def test_unknown_model_fields_are_refused_when_set():
    for overrides in (["model.num_layer=2"], ["model_overrides={'num_layer': 2}"]):
        with pytest.raises(UserError, match=r"^unknown GPTConfig field\(s\): 'num_layer' \(did you "
                                            r"mean 'num_layers'\?\); valid fields: \["):
            apply_overrides(ExperimentConfig(), overrides)
    with pytest.raises(UserError, match=r"^unknown T5Config field\(s\): 'n_positions'"):
        apply_overrides(ExperimentConfig(), ["model=t5", "model.n_positions=8"])
    with pytest.raises(UserError, match=r"^override key 3 is not a field name \(str\)$"):
        apply_overrides(ExperimentConfig(), {3: 1})


def test_log_fields_are_set_as_log_dot_field_and_checked():
    """``log.FIELD`` sets one LogConfig field; the config round-trips through JSON as a dict;
    a config.json from before ``log`` existed reads as the defaults."""
    cfg = apply_overrides(ExperimentConfig(), ["log.wandb=true", "log.wandb_project=demo"])
    assert cfg.log == LogConfig(wandb=True, wandb_project="demo")
    assert cfg.to_dict()["log"] == {"wandb": True, "wandb_project": "demo",
                                    "wandb_run_name": None, "wandb_mode": None}
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg
    assert apply_overrides(cfg, ["log={'wandb_mode': 'offline'}"]).log == LogConfig(
        wandb=True, wandb_project="demo", wandb_mode="offline")
    old = {k: v for k, v in ExperimentConfig().to_dict().items() if k != "log"}
    assert ExperimentConfig.from_dict(old).log == LogConfig()
    for override, message in [
        ("log.wandbb=true", "unknown LogConfig field(s): 'wandbb' (did you mean 'wandb'?); valid "
                            "fields: ['wandb', 'wandb_mode', 'wandb_project', 'wandb_run_name']"),
        ("log.wandb=1", "LogConfig.wandb must be True or False, got 1"),
        ("log.wandb_mode=cloud", "LogConfig.wandb_mode='cloud' is unknown; choose 'online', "
                                 "'offline' or None (online with an API key, else offline)"),
        ("log.wandb_project=", "LogConfig.wandb_project must be a non-empty string, got ''"),
        ("log=true", "log must be a dict (e.g. log={'wandb': True}), got True; or set one "
                     "field as log.FIELD=value"),
    ]:
        with pytest.raises(UserError) as info:
            apply_overrides(ExperimentConfig(), [override])
        assert str(info.value) == message


# ----------------------------------------------------------------------------- the CLI

@pytest.mark.parametrize("sets, message", [
    (["learning_rate=-0.001"], "error: ExperimentConfig.learning_rate must be a number > 0 (the "
                               "peak; noam: its scale factor), got -0.001"),
    (["model.num_layers=0"], "error: GPTConfig.num_layers must be an integer >= 1, got 0"),
    (["model.num_layers=abc"], "error: GPTConfig.num_layers must be an integer >= 1, got 'abc'"),
    (["model.num_layers=1.5"], "error: GPTConfig.num_layers must be an integer >= 1, got 1.5"),
    (["model.d_model=102"], "error: GPTConfig.d_model=102 is not divisible by num_heads=4"),
    (["model.num_layer=2"], "error: unknown GPTConfig field(s): 'num_layer' (did you mean "
                            "'num_layers'?); valid fields: "),
    (["seq_len=512"], "error: ExperimentConfig.seq_len=512 exceeds the model's max_len=256; lower "
                      "seq_len or set model.max_len>=512"),
    (["warmup_steps=-5"], "error: ExperimentConfig.warmup_steps must be an integer >= 0, got -5"),
    (["b2=1"], "error: ExperimentConfig.b2 must be a number in [0, 1), got 1"),
    (["end_learning_rate=0.1"], "error: ExperimentConfig.end_learning_rate=0.1 must be <= "
                                "learning_rate=0.002 (the cosine decays from learning_rate to "
                                "end_learning_rate)"),
    (["schedule=cosine"], "error: ExperimentConfig.schedule='cosine' is unknown; choose one of "
                          "['constant', 'noam', 'warmup_cosine', 'warmup_rsqrt', 'warmup_times_cosine']"),
    (["model=gpt3"], "error: ExperimentConfig.model='gpt3' is unknown; choose one of ['bert', "
                     "'clip', 'gemma', 'gpt', 't5', 'transformer', 'vit']"),
    # refused before the task would train a SentencePiece model into the workdir
    (["tokenizer=sentencepiece", "model.num_heads=0"],
     "error: GPTConfig.num_heads must be an integer >= 1, got 0"),
])
def test_cli_one_error_line_exit_2_nothing_written(capsys, tmp_path, monkeypatch, sets, message):
    def train(*args, **kwargs):
        raise AssertionError("the config should have been refused before the run")
    monkeypatch.setattr(run_module, "train", train)
    workdir = tmp_path / "run"
    args = ["train", "--workdir", str(workdir), "--no-progress"]
    for item in sets:
        args += ["--set", item]
    code = cli_main(args)
    out = capsys.readouterr()
    assert code == 2
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert out.out == ""                   # refused before "training ..." is printed
    assert not workdir.exists()


def test_named_model_fields_are_those_apply_overrides_sets():
    """What an ``--init-from`` start reports as not applying (``run.train(given_model=)``):
    the model fields the ``--set`` strings name, however they name them."""
    sets = ["model.num_layers=2", "lora.rank=4", "model_overrides={'d_model': 8, 'max_len': 512}",
            "steps=3", "task.text_key=body", "log.wandb=false"]
    assert named_model_fields(sets) == {"num_layers", "lora", "d_model", "max_len"}
    applied = apply_overrides(ExperimentConfig(model_overrides={}), sets)
    assert set(applied.model_overrides) == named_model_fields(sets)
    assert named_model_fields(["steps=3"]) == frozenset()
