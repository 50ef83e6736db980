"""``transformer-jax sweep``: the grid of an experiment file, one run per member,
``results.jsonl``, and a sweep stopped by SIGTERM and started again giving the same rows."""
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from transformer_jax.cli import _parser
from transformer_jax.errors import UserError
from transformer_jax.sweep import Member, members_of, run_sweep

REPO = Path(__file__).resolve().parents[1]

# Two members on the embedded corpus: "a" is quick; "b" is long enough (160 steps, a
# checkpoint every 20) for a SIGTERM, sent once its first checkpoint is on disk, to land in
# the middle of it (140 steps, a few seconds, before "b" would end).
TINY_SWEEP = '''
from transformer_jax.train.config import ExperimentConfig

def get_config():
    return ExperimentConfig(
        name="tiny_sweep", data_dir={data_dir!r}, seq_len=32, batch_size=8, steps=12,
        warmup_steps=2, schedule="constant", log_every=4, eval_every=4, eval_batches=2,
        save_every=4, sample_tokens=0,
        model_overrides=dict(num_layers=1, d_model=16, num_heads=2, max_len=32))

def get_sweep(quick):
    return [{{"name": "a", "group": "size", "set": ["model.d_model=16"]}},
            {{"name": "b", "group": "data", "set": {{"model.d_model": 32, "steps": 160,
             "eval_every": 40, "save_every": 20, "task.train_tokens": 6000}}}}]
'''


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("experiments") / "tiny_sweep.py"
    path.write_text(TINY_SWEEP.format(data_dir=data_dir))
    return path


def _sweep_cmd(experiment, workdir, *extra):
    return [sys.executable, "-m", "transformer_jax.cli", "sweep", "--experiment", str(experiment),
            "--workdir", str(workdir), "--no-progress", *extra]


def _latest_checkpoint(member_dir: Path) -> int:
    steps = [int(p.name) for p in (member_dir / "checkpoints").glob("*") if p.name.isdigit()]
    return max(steps, default=0)


@pytest.mark.slow
def test_sigterm_then_restart_gives_the_rows_of_an_uninterrupted_sweep(tmp_path, experiment):
    # the reference: both members at once, as two `transformer-jax train` processes
    ref = subprocess.run(_sweep_cmd(experiment, tmp_path / "ref", "--parallel", "2"), cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = (tmp_path / "ref" / "results.jsonl").read_text()

    # one after another in one process, stopped by SIGTERM while "b" trains
    work = tmp_path / "interrupted"
    cmd = _sweep_cmd(experiment, work, "--set", "eval_batches=2")   # the file's value: same rows
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while _latest_checkpoint(work / "b") < 20:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < 300, "member b made no checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "sweep tiny_sweep: 1/2 members done (a: eval loss " in out     # despite --no-progress
    hint = "stopped by SIGTERM with 1/2 members done; run the same command again to continue: "
    restart = [line[len(hint):] for line in err.splitlines() if line.startswith(hint)]
    parse = _parser().parse_args                                    # every flag, --set kept
    assert len(restart) == 1 and parse(shlex.split(restart[0])[1:]) == parse(cmd[3:])
    stopped = _latest_checkpoint(work / "b")
    assert 20 <= stopped < 160, stopped              # in the middle of "b"
    assert [r["member"] for r in map(json.loads, (work / "results.jsonl").read_text().splitlines())] == ["a"]

    # started again (here through the API): "a" is skipped, "b" resumes from its checkpoint
    seen = []
    out = run_sweep(str(experiment), work, progress=False, overrides=["eval_batches=2"],
                    on_member=lambda name, rows: seen.append((name, len(rows))))
    assert seen == [("b", 2)]
    got = (work / "results.jsonl").read_text()
    assert got == want                               # byte for byte: every eval of every member
    rows = [json.loads(line) for line in got.splitlines()]
    assert out["rows"] == rows and [r["member"] for r in rows] == ["a", "b"]
    a, b = rows
    assert a["group"] == "size" and b["group"] == "data" and b["train_tokens"] == 6000
    assert [p["step"] for p in a["curve"]] == [4, 8, 12]
    assert [p["step"] for p in b["curve"]] == [40, 80, 120, 160]
    assert b["best_eval_loss"] == min(p["eval_loss"] for p in b["curve"])
    assert a["final_eval_loss"] == a["curve"][-1]["eval_loss"]
    # a member's row is its run's metrics: the eval rows of its metrics.jsonl
    evals = [json.loads(line) for line in (work / "b" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_array_equal([r["eval_loss"] for r in evals if "eval_loss" in r],
                                  [p["eval_loss"] for p in b["curve"]])
    assert json.loads((work / "sweep.json").read_text())["seconds"].keys() == {"a", "b"}
    # started again with other settings for every member: refused, nothing mixed
    with pytest.raises(UserError, match=r"a was trained with other settings than the sweep gives "
                                        r"it now \(seed: 0 then, 1 now\)"):
        run_sweep(str(experiment), work, progress=False, overrides=["seed=1"])
    # other logging settings change no result: the finished members stand
    again = run_sweep(str(experiment), work, progress=False,
                      overrides=["eval_batches=2", "log.wandb_project=elsewhere"])
    assert again["rows"] == rows and (work / "results.jsonl").read_text() == want


def test_an_interrupted_sweep_prints_the_whole_command_that_continues_it(tmp_path, capsys,
                                                                        monkeypatch):
    """The restart hint repeats every flag (``--set`` included, shell-quoted): parsed again,
    it is the command that was run."""
    from transformer_jax import cli
    from transformer_jax import sweep

    def stopped(*args, **kwargs):
        raise sweep.SweepInterrupted(signal.SIGTERM, 1, 3)

    monkeypatch.setattr(sweep, "run_sweep", stopped)
    argv = ["sweep", "--experiment", "scaling_laws", "--workdir", str(tmp_path / "my runs"),
            "--quick", "--parallel", "2", "--set", "steps=20", "--set", "model.lora={'rank': 4}",
            "--no-progress"]
    assert cli.main(argv) == 143
    err = capsys.readouterr().err.splitlines()
    head = "stopped by SIGTERM with 1/3 members done; run the same command again to continue: "
    assert len(err) == 1 and err[0].startswith(head)
    assert shlex.split(err[0][len(head):]) == ["transformer-jax", *argv]


def test_flops_and_parameter_counts_follow_the_readme_formula(tmp_path, data_dir):
    """docs/scaling_laws.md: C = tokens x (6 (N + V D) + 12 L D T), N the non-embedding parameters
    (per layer 12 D^2 + 13 D with biases and LayerNorms, and the final norm's 2 D)."""
    page = (REPO / "docs" / "scaling_laws.md").read_text()
    assert "6 (N + V·D) + 12·L·D·T" in page
    path = tmp_path / "widths.py"
    path.write_text(TINY_SWEEP.format(data_dir=data_dir).split("def get_sweep")[0]
                    + "SWEEP = [['model.num_layers=1'], ['model.num_layers=2', 'model.d_model=32']]\n")
    out = run_sweep(str(path), tmp_path / "one", progress=False, overrides=["steps=4"])
    assert [r["member"] for r in out["rows"]] == ["num_layers-1", "num_layers-2_d_model-32"]
    for row, (layers, width) in zip(out["rows"], [(1, 16), (2, 32)]):
        n = layers * (12 * width ** 2 + 13 * width) + 2 * width
        vocab, t = 259, 32
        assert row["non_embedding_params"] == n
        assert row["params"] == n + vocab * width + 32 * width      # + tied wte + learned wpe
        assert row["tokens"] == 4 * 8 * t
        assert row["flops"] == row["tokens"] * (6 * (n + vocab * width) + 12 * layers * width * t)
        assert row["flops_per_token"] * row["tokens"] == row["flops"]


# --------------------------------------------------------------------------- the grid

class _Module:
    __file__ = "grid.py"

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_grid_forms_names_and_meta():
    module = _Module(get_sweep=lambda quick: [
        ["model.d_model=64", "steps=10"] if quick else ["model.d_model=128"],
        {"model.num_layers": 2, "dataset": "lm1b"},
        {"name": "data-1000", "group": "data", "set": {"task.train_tokens": 1000}}])
    quick = members_of(module, quick=True)
    assert quick == [Member("d_model-64_steps-10", ("model.d_model=64", "steps=10")),
                     Member("num_layers-2_dataset-lm1b", ("model.num_layers=2", "dataset='lm1b'")),
                     Member("data-1000", ("task.train_tokens=1000",), {"group": "data"})]
    assert members_of(module, quick=False)[0].overrides == ("model.d_model=128",)
    assert members_of(_Module(SWEEP=[["seed=1"]]), quick=False) == [Member("seed-1", ("seed=1",))]


@pytest.mark.parametrize("attrs, message", [
    ({}, "defines no grid: add SWEEP"),
    ({"SWEEP": []}, "must be a non-empty list"),
    ({"SWEEP": [["steps"]]}, "list of 'key=value' strings or a dict"),
    ({"SWEEP": [["seed=1"], {"seed": 1}]}, "appear twice in the grid"),
    ({"SWEEP": [{"name": "../up", "set": ["seed=1"]}]}, "is not a directory name"),
])
def test_grid_mistakes_are_refused(attrs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        members_of(_Module(**attrs), quick=False)


def test_sweep_mistakes_are_refused_before_anything_runs(tmp_path, experiment):
    with pytest.raises(UserError, match="--parallel 0 must be an int >= 1"):
        run_sweep(str(experiment), tmp_path / "w", parallel=0)
    with pytest.raises(UserError, match="unknown config field 'stepz'"):
        run_sweep(str(experiment), tmp_path / "w", overrides=["stepz=3"])
    assert not (tmp_path / "w").exists()
    # a member directory run with other overrides than the grid now gives
    (tmp_path / "w" / "a").mkdir(parents=True)
    (tmp_path / "w" / "a" / "result.json").write_text(json.dumps({"overrides": ["model.d_model=8"]}))
    with pytest.raises(UserError, match=r"a was run with overrides \['model.d_model=8'\], but the "
                                        r"grid now gives \['model.d_model=16'\]"):
        run_sweep(str(experiment), tmp_path / "w", progress=False)


# --------------------------------------------------------------------------- the scaling study

@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_scaling_laws_grid_spans_what_the_laws_need(quick):
    """>= 6 sizes over >= 2 decades of non-embedding parameters, one token budget; nested
    data subsets over >= 1.5 decades; every member's config valid; the full grid's FLOPs
    (the formula in docs/scaling_laws.md, bytes: V = 259) as its docstring states them (about 5e16)."""
    from transformer_jax.models import GPTConfig
    from transformer_jax.train.config import experiment_module
    from transformer_jax.sweep import member_config

    module = experiment_module("scaling_laws")
    members = members_of(module, quick)
    configs = {m.name: member_config(module.get_config(), [], m) for m in members}
    size = [m for m in members if m.meta["group"] == "size"]
    data = [m for m in members if m.meta["group"] == "data"]
    assert len(size) >= 6 and len(data) >= 5 and len(size) + len(data) == len(members)

    def model(cfg):
        return GPTConfig.preset(cfg.model_preset, **{**cfg.model_overrides, "vocab_size": 259})

    n = [model(configs[m.name]).num_params(non_embedding=True) for m in size]
    assert n == sorted(n) and np.log10(n[-1] / n[0]) >= 2
    assert len({configs[m.name].steps * configs[m.name].batch_size * configs[m.name].seq_len
                for m in size}) == 1
    subsets = [configs[m.name].task_options["train_tokens"] for m in data]
    assert subsets == sorted(subsets) and np.log10(subsets[-1] / subsets[0]) >= 1.5
    assert len({model(configs[m.name]) for m in data}) == 1
    # the full grid's corpus is read without TensorFlow (Colab's TPU runtime has none)
    dataset = {(c.dataset, c.eval_split) for c in configs.values()}
    assert dataset == ({("python_stdlib", "validation")} if quick else
                       {("hf:Salesforce/wikitext:wikitext-103-raw-v1", "validation")})
    if not quick:
        flops = sum(c.steps * c.batch_size * c.seq_len * model(c).flops_per_token(c.seq_len)
                    for c in configs.values())
        assert 4e16 < flops < 6e16, flops
