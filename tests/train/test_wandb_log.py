"""W&B logging (``--set log.wandb=true``, ``train/wandb_log.py``): a tiny run in offline mode,
paused and resumed, read back from the W&B files it left in the workdir: the same W&B run,
every metrics.jsonl value at its step, the samples, the loss plot and the config; the mode
chosen without a key; the one error line without the package."""
import html
import json
import sys

import pytest

from transformer_jax.run import train
from transformer_jax.train import wandb_log
from transformer_jax.train.config import LogConfig
from transformer_jax.train.monitor import read_metrics

from ..helpers import TINY_RUN, tiny_cfg

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def wandb_records(path) -> list:
    """The records of a W&B run file (``run-ID.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log blocks of 32 KiB holding records of a 7-byte header (CRC32,
    length, kind: 1 full, 2 first, 3 middle, 4 last) and a ``Record`` protobuf."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(records) -> dict[int, dict]:
    """step -> {key: value} of the run's history rows (nested keys joined by '/')."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in r.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No W&B credentials and no mode set: the run must choose offline itself."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_an_offline_run_holds_what_metrics_jsonl_holds(tmp_path, data_dir, offline, capsys):
    """Paused at step 5 and resumed to 8: one W&B run id in both parts; each metrics.jsonl row
    (train rows and evals) is in W&B's history at its step with the same values; a sample
    at each eval; the loss plot at the end; the run config; one line naming the directory."""
    cfg = tiny_cfg(data_dir, steps=8, **{"log.wandb": True})
    workdir = tmp_path / "run"
    train(cfg, workdir, progress=False, stop_at=5)
    train(cfg, workdir, progress=False, resume=True)
    runs = sorted((workdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb:")]
    assert lines == [f"wandb: offline run in {d}; sync with: wandb sync {d}" for d in runs]
    run_id = (workdir / "wandb" / "run_id").read_text().strip()
    parts = [wandb_records(d / f"run-{run_id}.wandb") for d in runs]
    for records in parts:
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project, run.display_name) == (run_id, "transformer_jax", "run")
        config = {i.key: json.loads(i.value_json) for i in run.config.update}
        assert config["experiment"]["log"]["wandb"] is True
        assert config["experiment"]["steps"] == 8 and config["family"] == "gpt"
        (done,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
        assert done.exit_code == 0
    first, second = history(parts[0]), history(parts[1])
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [6, 7, 8]
    logged = {**first, **second}
    rows = read_metrics(workdir)
    assert sorted({r["step"] for r in rows}) == list(range(1, 9))
    for row in rows:
        got = {k: logged[row["step"]][k] for k in row if k != "step"}
        assert got == {k: v for k, v in row.items() if k != "step"}, row["step"]
    assert [s for s in logged if "eval_loss" in logged[s]] == [5, 8]
    assert [s for s in logged if "sample/_type" in logged[s]] == [5, 8]
    assert logged[8]["sample/_type"] == "html-file"
    sample = (runs[1] / "files" / logged[8]["sample/path"]).read_text()
    last = (workdir / "samples.txt").read_text().split("=== step 8 ")[1].split("\n", 1)[1]
    assert sample == f"<pre>{html.escape(last[:-1])}</pre>"      # samples.txt's, as HTML
    assert [s for s in logged if "loss_curve/_type" in logged[s]] == [5, 8]
    assert logged[8]["loss_curve/_type"] == "image-file"
    assert (runs[1] / "files" / logged[8]["loss_curve/path"]).read_bytes()[:4] == b"\x89PNG"


def test_without_wandb_one_error_line_and_nothing_written(tmp_path, data_dir, here, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)        # `import wandb` raises ImportError
    workdir = tmp_path / "run"
    sets = [x for s in TINY_RUN + [f"data_dir={data_dir}", "log.wandb=true"] for x in ("--set", s)]
    code, out, lines = here("train", "--workdir", workdir, "--steps", 2, *sets)
    assert code == 2
    assert lines == ["error: log.wandb=true logs to Weights & Biases, but wandb is not installed; "
                     "pip install -e '.[wandb]' (or pip install wandb), or drop --set "
                     "log.wandb=true"]
    assert not workdir.exists()


def test_the_mode_is_offline_without_a_key(tmp_path, offline, monkeypatch):
    assert wandb_log.resolve_mode(LogConfig(wandb=True)) == "offline"
    assert wandb_log.resolve_mode(LogConfig(wandb=True, wandb_mode="online")) == "online"
    key = "k" * 40
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))      # what `wandb login` writes
    assert wandb_log.resolve_mode(LogConfig(wandb=True)) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_log.resolve_mode(LogConfig(wandb=True)) == "offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_log.resolve_mode(LogConfig(wandb=True)) == "online"


def test_an_unreachable_server_is_refused_when_chosen_and_logged_offline_when_implied(
        tmp_path, data_dir, offline, here, monkeypatch):
    """An API key set and W&B's server not answering (a closed local port, no retries):
    online chosen (``log.wandb_mode=online``, ``WANDB_MODE=online``) is one error line
    before anything is written; online implied by the key logs offline, with one warning
    and the offline run's line. A server that answers keeps the run online."""
    url = "http://127.0.0.1:9"               # the discard port: nothing listens
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    why = "ConnectionRefusedError: [Errno 111] Connection refused"
    assert wandb_log.unreachable(url) == why
    # a server that answers, whatever it answers (here 501: no HEAD), is reachable: online stays
    import http.server
    import threading
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    assert wandb_log.choose_mode(LogConfig(wandb=True), say=pytest.fail) == "online"
    server.server_close()
    monkeypatch.setenv("WANDB_BASE_URL", url)
    workdir = tmp_path / "run"
    sets = [x for s in TINY_RUN + [f"data_dir={data_dir}", "log.wandb=true", "eval_every=2",
                                   "save_every=2"] for x in ("--set", s)]
    refused = (f"logs to W&B at {url}, which cannot be reached ({why}); log offline and upload "
               "later with `wandb sync` (--set log.wandb_mode=offline), or drop --set "
               "log.wandb=true")
    assert here("train", "--workdir", workdir, "--steps", 2, *sets, "--set",
                "log.wandb_mode=online")[::2] == (2, [f"error: log.wandb_mode=online {refused}"])
    monkeypatch.setenv("WANDB_MODE", "online")
    assert here("train", "--workdir", workdir, "--steps", 2, *sets)[::2] == (
        2, [f"error: WANDB_MODE=online {refused}"])
    assert not workdir.exists()
    monkeypatch.delenv("WANDB_MODE")
    code, out, lines = here("train", "--workdir", workdir, "--steps", 2, *sets)
    assert (code, lines) == (0, [
        f"warning: W&B at {url} cannot be reached ({why}): logging offline instead, for `wandb "
        "sync` to upload later (--set log.wandb_mode=offline chooses that, log.wandb_mode=online "
        "refuses to start instead)"])
    (run,) = sorted((workdir / "wandb").glob("offline-run-*"))
    assert f"wandb: offline run in {run}; sync with: wandb sync {run}" in out.splitlines()
