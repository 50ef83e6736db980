"""What happens when things go wrong, through the real CLI (issue 20).

One run trained to step 10 (checkpoints 5 and 10) is copied into each test, which then
breaks something: the learning rate, a checkpoint file, metrics.jsonl, the workdir, the
disk. Each test asserts the lines the user sees and the state of the workdir afterwards.

The CLI's ``main`` runs in this process (``here``: the same exit status and lines, read
at the file descriptors, without a process start and its imports each time), except
where the process itself is the point: a file-size limit (the full disk) and dropped
capabilities (the unwritable workdir) run ``transformer-jax`` in a subprocess.
"""
import ctypes
import json
import os
import resource
import shutil
from pathlib import Path

import pytest

from tests.helpers import TINY_RUN, cli, cli_here, snapshot
from transformer_jax.cli import main as cli_main

pytestmark = pytest.mark.slow


def summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("\n{\n") + 1:])


def train(run_cli, workdir, *extra, steps):
    """``transformer-jax train`` of TINY_RUN through ``run_cli`` (``here`` or ``cli``)."""
    return run_cli("train", "--workdir", str(workdir), "--no-progress",
                   *[f"--set={s}" for s in TINY_RUN], f"--steps={steps}", *extra)


def losses(workdir) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def listing(workdir) -> list[str]:
    return sorted(p.name for p in (Path(workdir) / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir):
    """A run trained to step 10 (checkpoints 5 and 10), and its losses."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    code, _, lines = train(cli_here, workdir, f"--set=data_dir={data_dir}", steps=10)
    assert code == 0 and lines == []
    assert listing(workdir) == ["10", "5"]
    return workdir, losses(workdir)


@pytest.fixture
def run(base, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(base[0], workdir)
    return workdir


def test_divergence_names_a_checkpoint_from_before_it_and_its_advice_works(run, base, data_dir, here):
    # a learning rate of 1e8 from step 11: the update of step 11 blows up the weights, so the
    # loss of step 12 (of the weights after 11 updates) is a spike and step 13's is NaN
    code, _, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", "--set=learning_rate=1e8",
                           "--set=save_every=1", steps=40)
    assert code == 3
    ckpt = run / "checkpoints"
    assert lines[0].startswith("warning: step 12 not saved, nor any later step until the loss is "
                               "healthy again: the loss rose to ")
    assert lines[0].endswith("; checkpoint step 11 stays the latest")
    assert lines[1].startswith("error: loss became nan at step 13 (the loss rose to ")
    assert lines[1].endswith(
        f"the run stopped without saving this state; checkpoint step 10 in {ckpt} is from before "
        f"the blow-up; the checkpoints saved as it rose were moved aside ({ckpt}/11.diverged); "
        "lower learning_rate (or clip_norm) and continue with --resume (it restores step 10; "
        "--resume-from 10 says the same).")
    assert len(lines) == 2 and listing(run) == ["10", "11.diverged"]   # keep=2 dropped step 5
    diverged = losses(run)
    assert diverged[12] > 3 * diverged[11]
    # the advice, literally: the learning rate back down, --resume
    code, out, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", steps=14)
    assert code == 0 and lines == [] and summary(out)["start_step"] == 10
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 15))
    assert resumed[11] == diverged[11]   # the loss of the restored weights, before any update
    assert all(resumed[s] < 6.0 for s in range(11, 15))


def test_an_unreadable_checkpoint_and_a_torn_metrics_line_are_skipped(run, base, data_dir, here):
    array = max((run / "checkpoints" / "10" / "state" / "ocdbt.process_0" / "d").iterdir(),
                key=lambda p: p.stat().st_size)
    array.write_bytes(array.read_bytes()[:1000])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')
    torn_line = len((run / "metrics.jsonl").read_text().splitlines())
    unreadable = (f"warning: checkpoint step 10 in {run / 'checkpoints'} is unreadable: state/ "
                  "(the array ")
    # eval and generate use step 5 and move nothing
    code, out, lines = here("eval", "--workdir", str(run))
    assert code == 0 and len(lines) == 1 and lines[0].startswith(unreadable)
    assert lines[0].endswith("; restoring step 5 instead")
    assert json.loads(out)["eval_loss"] > 0
    code, out, lines = here("generate", "--workdir", str(run), "--prompt", "def ", "--max-new-tokens", "4")
    assert code == 0 and len(lines) == 1 and lines[0].startswith(unreadable) and out.startswith("def ")
    assert listing(run) == ["10", "5"]
    # a resumed run moves step 10 aside and continues from step 5, exactly as the first run did
    code, out, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", steps=12)
    assert code == 0 and summary(out)["start_step"] == 5
    assert lines[0].startswith(unreadable)
    assert lines[0].endswith(f"; moved it to {run / 'checkpoints'}/10.corrupt; restoring step 5 instead")
    assert lines[1] == (f"warning: {run / 'metrics.jsonl'} line {torn_line} is not a metrics row "
                        "(torn by an interrupted write?): '{\"step\": 11, \"lo'; skipped it")
    assert len(lines) == 2 and listing(run) == ["10", "10.corrupt", "12"]
    resumed = losses(run)
    assert [resumed[s] for s in range(6, 11)] == [base[1][s] for s in range(6, 11)]


def test_refused_runs_leave_the_workdir_as_it_was(run, data_dir, here):
    before = snapshot(run)
    ckpt = run / "checkpoints"
    code, _, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", "--set=model.d_model=64",
                           steps=20)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("error: the checkpoint in this workdir does not match the config: "
                               "model config differs (field: (checkpoint, now)) {'d_model': (32, 64)")
    code, _, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", steps=10)
    assert code == 0 and lines == []
    code, _, lines = train(here, run, "--resume-from", "7", f"--set=data_dir={data_dir}", steps=20)
    assert code == 2 and lines == [f"error: No checkpoint for step 7 in {ckpt}; available steps: "
                                   "[5, 10]; pick one of them"]
    code, _, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", "--set=model.num_layers=0",
                           steps=20)
    assert code == 2 and len(lines) == 1 and "num_layers" in lines[0] and "0" in lines[0]
    assert snapshot(run) == before


def test_nothing_to_do_says_so_and_writes_nothing(run, data_dir, capfd):
    before = snapshot(run)
    capfd.readouterr()
    code = cli_main(["train", "--workdir", str(run), "--resume", "--no-progress",
                     *[f"--set={s}" for s in TINY_RUN], f"--set=data_dir={data_dir}", "--steps=8"])
    err = capfd.readouterr().err
    assert code == 0 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"nothing to do: the checkpoint in {run / 'checkpoints'} is at step 10, and steps=8; give "
        "--steps above 10 to train further")
    assert snapshot(run) == before


def test_resume_from_any_kept_step_sets_the_later_ones_aside(run, base, data_dir, here):
    code, out, lines = train(here, run, "--resume-from", "5", f"--set=data_dir={data_dir}", steps=7)
    assert code == 0 and summary(out)["start_step"] == 5
    assert lines == [f"warning: --resume-from 5: moved the later checkpoints aside: "
                     f"{run / 'checkpoints'}/10.superseded"]
    assert listing(run) == ["10.superseded", "5", "7"]
    assert [losses(run)[s] for s in (6, 7)] == [base[1][6], base[1][7]]


def test_resume_on_a_workdir_without_checkpoints_warns_and_starts_fresh(tmp_path, data_dir, here):
    code, out, lines = train(here, tmp_path / "typo", "--resume", f"--set=data_dir={data_dir}", steps=2)
    assert code == 0 and summary(out)["start_step"] == 0 and summary(out)["final_step"] == 2
    assert lines == [f"warning: --resume: {tmp_path / 'typo'} holds no checkpoint, so this run "
                     "starts from step 0 (check the --workdir if you meant to continue a run)"]


def test_a_workdir_that_is_a_file_or_unwritable_is_one_line(tmp_path, here):
    (tmp_path / "afile").write_text("x")
    code, _, lines = here("train", "--workdir", str(tmp_path / "afile"))
    assert code == 2 and lines == [f"error: --workdir {tmp_path / 'afile'} is a file, not a "
                                   "directory; give the path of a directory (it is created if missing)"]
    # a directory this process may not write to; root writes anywhere, so as root the CLI
    # runs without the capabilities that override file permissions
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    code, _, lines = cli("train", "--workdir", str(locked / "run"), preexec_fn=_without_root_overrides)
    locked.chmod(0o755)
    assert code == 2 and lines == [f"error: cannot write to {locked} (Permission denied); choose "
                                   "a --workdir on a writable disk with free space, or fix its "
                                   "permissions"]
    assert list(locked.iterdir()) == []


def _without_root_overrides():
    """In the child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
    capability bounding set (prctl PR_CAPBSET_DROP), so file permissions apply to root too."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_checkpoint_cut_short_by_a_full_disk_keeps_the_previous_one(run, base, data_dir, here):
    # files of at most 40 KiB: the rows and the config fit, the checkpoint's array data do not
    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40 * 1024, resource.RLIM_INFINITY))

    code, _, lines = cli("train", "--workdir", str(run), "--no-progress", "--resume",
                         *[f"--set={s}" for s in TINY_RUN], f"--set=data_dir={data_dir}", "--steps=15",
                         preexec_fn=small_disk)
    assert code == 2 and lines == [
        f"error: could not write the checkpoint of step 15 to {run / 'checkpoints'} (File too "
        "large); the previous checkpoint, step 10, is intact: free space (or choose a --workdir "
        "on a disk with room) and continue with --resume"]
    assert listing(run) == ["10", "15.orbax-checkpoint-tmp", "5"]
    code, out, lines = train(here, run, "--resume", f"--set=data_dir={data_dir}", steps=15)
    assert code == 0 and lines == [] and summary(out)["start_step"] == 10
    assert listing(run) == ["10", "15"]


def test_a_resume_takes_the_runs_settings_and_set_changes_them(run, data_dir, here):
    """``--resume`` alone (no experiment, no --set) continues with the run's config.json:
    TINY_RUN's model, learning rate 3e-3 (constant) and warm-up 2, not the experiment's
    defaults (a 4-layer model, warmup_cosine at 2e-3 after 50 steps, which would refuse the
    checkpoint); ``--set learning_rate=...`` then changes the rate, and config.json says so."""
    before = json.loads((run / "config.json").read_text())
    code, out, lines = here("train", "--workdir", str(run), "--resume", "--steps", "12", "--no-progress")
    assert code == 0 and lines == [] and summary(out)["start_step"] == 10
    assert json.loads((run / "config.json").read_text()) == {
        **before, "experiment": {**before["experiment"], "steps": 12}}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["step"] in (11, 12) and "lr" in r] == [
        pytest.approx(3e-3, rel=1e-6)] * 2
    code, _, lines = here("train", "--workdir", str(run), "--resume", "--steps", "13",
                          "--set", "learning_rate=1e-3", "--no-progress")
    assert code == 0 and lines == []
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["step"] == 13 and "lr" in r] == [pytest.approx(1e-3, rel=1e-6)]
    assert json.loads((run / "config.json").read_text())["experiment"]["learning_rate"] == 1e-3
    # another experiment's name is not this run's settings
    code, _, lines = here("train", "--workdir", str(run), "--resume", "--steps", "14",
                          "--experiment", "bert_mlm_stdlib", "--no-progress")
    assert code == 2 and lines == [
        f"error: --experiment bert_mlm_stdlib is 'bert_mlm_stdlib', but {run} holds a run of "
        f"'stdlib_gpt'; drop --experiment (--resume takes the run's settings from "
        f"{run / 'config.json'}; --set changes them), or choose another --workdir"]


def test_generate_past_max_len_says_how_many_tokens_it_cut(base, here):
    """The model's max_len is 64 and its positions are a learned table: a 4-byte prompt
    leaves room for 60 new tokens, and a warning says 40 of the 100 asked for are cut."""
    code, out, lines = here("generate", "--workdir", str(base[0]), "--prompt", "def ",
                            "--max-new-tokens", "100")
    assert code == 0 and out.startswith("def ")
    assert lines == ["warning: the prompt (4 tokens) and --max-new-tokens 100 exceed the model's "
                     "max_len=64: at most 60 new tokens, 40 cut (its learned position table ends "
                     "there); a shorter prompt leaves more room"]
    code, out, lines = here("generate", "--workdir", str(base[0]), "--prompt", "def ",
                            "--max-new-tokens", "60")
    assert code == 0 and lines == []


def test_generate_with_a_sliding_window_decodes_past_max_len(tmp_path, data_dir, here):
    """A window of 8 over RoPE positions (max_len 32): 100 new tokens, greedy, no warning
    (tests/models/test_efficient_attention_models.py checks the tokens past max_len)."""
    code, _, lines = train(here, tmp_path / "window", f"--set=data_dir={data_dir}", "--set=model.max_len=32",
                           "--set=model.position=rope", "--set=model.attention_window=8",
                           "--set=eval_every=1", "--set=save_every=1", "--set=sample_tokens=0",
                           steps=1)
    assert code == 0 and lines == []
    code, out, lines = here("generate", "--workdir", str(tmp_path / "window"), "--prompt", "def ",
                            "--max-new-tokens", "100", "--temperature", "0")
    assert code == 0 and lines == []
    assert len(out.encode()) - 1 == 4 + 100      # bytes: the prompt, 100 tokens, print's newline
