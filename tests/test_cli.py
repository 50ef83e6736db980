"""The CLI's error contract: a user mistake (``UserError``) is one ``error:`` line and exit
status 2; anything else is a bug and keeps its traceback."""
import os
import subprocess
import sys
import textwrap

import pytest

from transformer_jax.cli import main as cli_main
from transformer_jax.errors import UserError
from transformer_jax import run as run_module


def run(capsys, *args):
    code = cli_main(list(args))
    out = capsys.readouterr()
    return code, out.err


@pytest.mark.parametrize("args, message", [
    (["train", "--set", "steps=abc"], "error: steps='abc' must be of type int (e.g. --set steps=600)"),
    (["train", "--set", "steps"], "error: override 'steps' is not of the form key=value (e.g. --set steps=100)"),
    (["train", "--set", "loss_scale=static"],
     "error: loss_scale='static' is unknown; choose 'auto' (dynamic for model.dtype=float16), "
     "'dynamic' or 'none'"),
    (["train", "--set", "mesh=data=2,data=4"], "error: mesh 'data=2,data=4': axis 'data' is given twice"),
    (["train", "--set", "model.vocab_size=100"],
     "error: model.vocab_size=100 is smaller than the 259 ids of the run's tokenizer, "
     "tokenizer='byte' (256 bytes and 3 special ids); drop the override (the task sets "
     "vocab_size from the tokenizer) or set it to at least 259"),
])
def test_a_bad_set_is_one_error_line_and_exit_2(capsys, tmp_path, args, message):
    code, err = run(capsys, *args, "--workdir", str(tmp_path))
    assert code == 2
    assert err.splitlines() == [message]


def test_model_field_mistakes_are_user_errors(capsys, tmp_path):
    """Model config validation (models/) raises ValueError; the loop passes it on as a
    UserError, so the CLI prints it as one line."""
    code, err = run(capsys, "train", "--set", "model.num_layer=1", "--set", "steps=2",
                    "--workdir", str(tmp_path / "a"), "--no-progress")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: unknown GPTConfig field(s): 'num_layer' (did you mean 'num_layers'?)")
    assert not (tmp_path / "a" / "checkpoints").exists()


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_missing_workdir_is_one_error_line_and_exit_2(capsys, tmp_path, command):
    extra = ["--prompt", "x"] if command == "generate" else []
    code, err = run(capsys, command, "--workdir", str(tmp_path / "nothing"), *extra)
    assert code == 2
    assert err.splitlines() == [f"error: {tmp_path / 'nothing'} has no checkpoints/ directory; give "
                                "the workdir of a `transformer-jax train` run, or train into it first"]


def test_a_bug_is_not_caught(capsys, tmp_path, monkeypatch):
    """Only UserError is a user mistake: a RuntimeError, or a plain ValueError from deep
    inside, propagates with its traceback."""
    def boom(*args, **kwargs):
        raise RuntimeError("an internal bug")
    monkeypatch.setattr(run_module, "setup", boom)
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli_main(["train", "--workdir", str(tmp_path), "--no-progress"])

    def value_bug(*args, **kwargs):
        raise ValueError("shapes (3,) and (4,) disagree")
    monkeypatch.setattr(run_module, "setup", value_bug)
    with pytest.raises(ValueError, match="disagree") as info:
        cli_main(["train", "--workdir", str(tmp_path), "--no-progress"])
    assert not isinstance(info.value, UserError)


def test_a_bug_prints_its_traceback_from_the_command_line(tmp_path):
    """The same from a real process: exit status 1 and Python's traceback on stderr."""
    script = textwrap.dedent(f"""
        import sys
        from transformer_jax import run
        def boom(*args, **kwargs):
            raise RuntimeError("an internal bug")
        run.setup = boom
        from transformer_jax.cli import main
        sys.exit(main(["train", "--workdir", {str(tmp_path)!r}, "--no-progress"]))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == "RuntimeError: an internal bug"
    assert "error:" not in proc.stderr


EXPERIMENT_HEAD = "from transformer_jax.train.config import ExperimentConfig\n"


@pytest.mark.parametrize("body, line, detail", [
    ("\ndef get_config(:\n    return ExperimentConfig()\n", 3,
     "SyntaxError: invalid syntax ('def get_config(:')"),
    ("import no_such_module_here\n\ndef get_config():\n    return ExperimentConfig()\n", 2,
     "importing it raised ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("\ndef get_config():\n    return ExperimentConfig(stepz=3)\n", 4,
     "get_config() raised TypeError: ExperimentConfig.__init__() got an unexpected keyword "
     "argument 'stepz'"),
])
@pytest.mark.parametrize("command", ["train", "sweep"])
def test_an_experiment_file_that_does_not_load_is_one_line_naming_file_and_line(
        capsys, tmp_path, command, body, line, detail):
    path = tmp_path / "broken.py"
    path.write_text(EXPERIMENT_HEAD + body)
    code, err = run(capsys, command, "--experiment", str(path), "--workdir", str(tmp_path / "w"))
    assert code == 2
    assert err.splitlines() == [f"error: experiment file {path}, line {line}: {detail}; fix the "
                                "file, or give another --experiment (`transformer-jax experiments` "
                                "lists them)"]
    assert not (tmp_path / "w").exists()
