"""gs:// workdirs against a real GCS JSON API server on localhost (``gcp-storage-emulator``).

The ``gcs`` fixture starts the emulator in a subprocess on a free port, creates a bucket and
sets ``STORAGE_EMULATOR_HOST``, the one switch that points gcsfs (epath) and tensorstore
(orbax) at it. Each test runs the same code on a local directory and on the bucket and
compares what reads back, byte for byte or number for number.
"""
from __future__ import annotations

import io
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import storage
from transformer_jax.errors import UserError
from transformer_jax.train.checkpoint import CheckpointManager, read_config
from transformer_jax.train.monitor import MetricsWriter, plot_loss, read_metrics

BUCKET = "tj-test"

# The emulator as its command line starts it, with what tensorstore (orbax) relies on and
# GCS does but the emulator lacks: object downloads carry ``x-goog-generation`` (without it
# tensorstore cannot condition its next write of an OCDBT manifest: "Malformed
# StorageGeneration", now and then), ``Expect: 100-continue`` is answered (else curl waits a
# second before each upload over 1 KiB), and the listen queue holds more than 5 connections
# (tensorstore opens many at once; a full queue drops them and the client waits to retry).
# It also exits when the test process does.
_EMULATOR = """
import os, sys, threading, time
from http.server import HTTPServer
from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.handlers import objects

download, parse_request = objects.download, server.RequestHandler.parse_request

def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status < 300:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]

def answer_100_continue(self):
    ok = parse_request(self)
    if ok and self.headers.get("Expect", "").lower() == "100-continue":
        self.wfile.write(b"HTTP/1.1 100 Continue\\r\\n\\r\\n")
        self.wfile.flush()
    return ok

def exit_with_parent(parent=os.getppid()):
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

objects.download = download_with_generation
server.RequestHandler.parse_request = answer_100_continue
HTTPServer.request_queue_size = 256
threading.Thread(target=exit_with_parent, daemon=True).start()
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the GCS emulator exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/", timeout=1) as r:
                if r.read() == b"OK":
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the GCS emulator did not answer at {url} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def gcs():
    """``gs://<bucket>`` on an emulator started for this module, with the switch set."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMULATOR, "start", "--host", "127.0.0.1",
         "--port", str(port), "--in-memory", "--default-bucket", BUCKET, "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    before = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        _wait_until_up(url, proc)
        os.environ["STORAGE_EMULATOR_HOST"] = url
        assert storage.configure_emulator() == url
        assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == url
        yield f"gs://{BUCKET}"
    finally:
        if before is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = before
        storage.configure_emulator()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    """The same test on a local directory and in the bucket (a fresh prefix per test)."""
    if request.param == "local":
        return str(tmp_path)
    bucket = request.getfixturevalue("gcs")
    return f"{bucket}/{request.node.name.replace('[', '-').strip(']')}-{time.monotonic_ns()}"


# ----------------------------------------------------------------------------- the switch

def test_emulator_switch_sets_and_undoes_the_client_settings(monkeypatch):
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    monkeypatch.delenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:1")   # host:port, no scheme
    try:
        assert storage.configure_emulator() == "http://127.0.0.1:1"
        assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:1"
        assert os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] == "emulator"
        assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
        assert os.environ["EPATH_USE_TF"] == "false"
        import fsspec

        assert fsspec.config.conf["gcs"]["token"] == "anon"
    finally:
        monkeypatch.delenv("STORAGE_EMULATOR_HOST")
        assert storage.configure_emulator() is None
    assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in os.environ
    assert "EPATH_USE_TF" not in os.environ
    assert "token" not in fsspec.config.conf.get("gcs", {})


# ----------------------------------------------------------------------------- storage layer

def test_storage_round_trips_text_bytes_and_appends(root):
    base = storage.makedirs(f"{root}/run")
    assert storage.is_remote(base) == root.startswith("gs://")
    storage.write_text(base / "a.txt", "héllo\n")
    storage.write_bytes(base / "sub/b.bin", bytes(range(256)))
    storage.append_text(base / "c.txt", "one\n")
    storage.append_text(base / "c.txt", "two\n")
    storage.write_text(base / "a.txt", "replaced\n")   # a second write replaces the first
    assert storage.read_text(base / "a.txt") == "replaced\n"
    assert storage.read_bytes(base / "sub/b.bin") == bytes(range(256))
    assert storage.read_text(base / "c.txt") == "one\ntwo\n"
    assert storage.is_file(base / "a.txt") and not storage.is_file(base / "sub")
    assert storage.is_dir(base / "sub") and storage.exists(base / "sub/b.bin")
    assert not storage.exists(base / "missing.txt")
    assert sorted(p.name for p in base.iterdir()) == ["a.txt", "c.txt", "sub"]


def test_text_log_buffers_rows_in_a_bucket_until_flush(root):
    log = storage.TextLog(f"{root}/metrics.jsonl", '{"step": 1}\n', flush_secs=3600)
    log.append('{"step": 2}\n')
    log.append('{"step": 3}\n')
    stored = storage.read_text(log.path)
    # an object cannot be appended to: the rows wait in memory until flush; a file gets them now
    if log.remote:
        assert stored == '{"step": 1}\n'
    else:
        assert stored == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    log.close()
    assert storage.read_text(log.path) == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def test_makedirs_in_a_missing_bucket_is_a_user_error(gcs):
    with pytest.raises(UserError, match="bucket gs://no-such-bucket-tj does not exist"):
        storage.makedirs("gs://no-such-bucket-tj/run")


# ----------------------------------------------------------------------------- checkpoints

def _state(seed):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)},
            "step": jnp.int32(seed)}


def test_checkpoint_manager_saves_and_restores(root):
    config = {"model": {"d_model": 8}, "name": "tiny"}
    with CheckpointManager(f"{root}/checkpoints", save_every=1, keep=1) as ckpt:
        for step, loss in ((1, 3.0), (2, 2.0), (3, 2.5)):
            ckpt.maybe_save(step, _state(step), config=config, data_state={"index": step},
                            metrics={"eval_loss": loss})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]   # the latest, and the best eval loss (step 2)
        assert ckpt.best_step() == 2
        state, saved_config, data_state = ckpt.restore(2, target=_state(0))
    want = _state(2)
    for got, ref in zip(np.array(state["params"]["w"]).ravel(), np.array(want["params"]["w"]).ravel()):
        assert got == ref
    np.testing.assert_array_equal(np.asarray(state["params"]["b"], np.float32),
                                  np.asarray(want["params"]["b"], np.float32))
    assert state["params"]["b"].dtype == jnp.bfloat16 and int(state["step"]) == 2
    assert saved_config == config and data_state == {"index": 2}
    assert read_config(f"{root}/checkpoints") == config
    assert storage.is_dir(f"{root}/checkpoints/3")


# ----------------------------------------------------------------------------- metrics, TB, plot

def _events(tb_dir) -> list[dict]:
    """Every event of every file in ``tb_dir`` (TFRecord framing read by hand, CRCs skipped)."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(storage.path(tb_dir).iterdir(), key=lambda p: p.name):
        data, pos = storage.read_bytes(f), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.append({"file": f.name, "step": event.step, "tag": v.tag,
                            "value": v.simple_value if v.HasField("simple_value") else None})
            if event.HasField("session_log"):
                out.append({"file": f.name, "step": event.step, "tag": "session_log"})
    return out


def test_metrics_writer_writes_jsonl_and_events_that_read_back(root):
    run = f"{root}/run"
    writer = MetricsWriter(run, flush_secs=3600)
    for step in (1, 2, 3, 4):
        writer.write(step, {"loss": 4.0 - 0.5 * step, "lr": np.float32(1e-3)})
    writer.text("sample", 4, "def f():")
    writer.flush()
    rows = read_metrics(run)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 3.5), (2, 3.0), (3, 2.5), (4, 2.0)]
    assert all(abs(r["lr"] - 1e-3) < 1e-9 for r in rows)
    writer.close()
    loss = [(e["step"], e["value"]) for e in _events(f"{run}/tb") if e["tag"] == "loss"]
    assert loss == [(1, 3.5), (2, 3.0), (3, 2.5), (4, 2.0)]

    # resume from step 2: rows past it are dropped, TensorBoard purges from step 3 on
    time.sleep(1.1)   # a new event file (tensorboardX names them by the second)
    writer = MetricsWriter(run, resume_step=2)
    writer.write(3, {"loss": 2.75})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(run)] == [(1, 3.5), (2, 3.0), (3, 2.75)]
    events = _events(f"{run}/tb")
    assert len({e["file"] for e in events}) == 2
    second = [e for e in events if e["file"] == max(x["file"] for x in events)]
    assert second[0] == {"file": second[0]["file"], "step": 3, "tag": "session_log"}
    assert [(e["step"], e["value"]) for e in second if e["tag"] == "loss"] == [(3, 2.75)]


def test_loss_plot_is_written_to_the_workdir(root):
    run = f"{root}/run"
    writer = MetricsWriter(run)
    for step in range(1, 6):
        writer.write(step, {"loss": 1.0 / step})
    writer.write(5, {"eval_loss": 0.3})
    writer.close()
    out = plot_loss(run)
    assert os.fspath(out) == os.fspath(storage.path(run) / "loss.png")
    png = storage.read_bytes(out)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (770, 440)   # figsize (7, 4) at 110 dpi


# ----------------------------------------------------------------------------- data in the bucket

def test_sentencepiece_model_in_the_bucket_equals_the_local_one(root, tmp_path):
    from transformer_jax.data import get_tokenizer, train_sentencepiece

    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    local = train_sentencepiece(texts, 320, tmp_path / "ref" / "spm.model")
    here = train_sentencepiece(texts, 320, f"{root}/tok/spm.model")
    again = get_tokenizer(f"sentencepiece:{root}/tok/spm.model")
    assert here.cache_key == local.cache_key == again.cache_key   # same model bytes
    sample = "def g(y):\n    return y * 7 + 49\n"
    assert again.encode(sample) == local.encode(sample)
    assert again.decode(again.encode(sample)) == sample


def test_token_stream_cache_in_a_bucket_data_dir(root):
    from transformer_jax.data.pipeline import _load_or_build_stream
    from transformer_jax.data.tokenizers import ByteTokenizer

    source = [{"text": "ab"}, {"text": "c"}]
    tok = ByteTokenizer()
    built = _load_or_build_stream(source, "toy", "train", tok, "text", root, True)
    cached = list(storage.path(root).glob("transformer_jax_cache/*.npy"))
    assert len(cached) == 1
    again = _load_or_build_stream(source, "toy", "train", tok, "text", root, True)
    want = [ord("a") + 3, ord("b") + 3, tok.eos_id, ord("c") + 3, tok.eos_id]
    assert np.asarray(built).tolist() == want and np.asarray(again).tolist() == want
    assert np.load(io.BytesIO(storage.read_bytes(cached[0]))).tolist() == want


def test_config_json_round_trips(root):
    config = {"experiment": {"name": "x", "steps": 3}, "family": "gpt"}
    storage.write_text(f"{root}/run/config.json", json.dumps(config, indent=2) + "\n")
    assert json.loads(storage.read_text(f"{root}/run/config.json")) == config


# ----------------------------------------------------------------------------- whole runs

RUN = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=64",
       "seq_len=32", "batch_size=4", "schedule=constant", "learning_rate=3e-3",
       "warmup_steps=2", "log_every=1", "eval_every=4", "save_every=4", "eval_batches=2",
       "sample_tokens=8", "steps=8"]


@pytest.mark.slow
def test_train_pause_resume_eval_generate_in_a_bucket(gcs, tmp_path):
    """train() into gs://, paused at step 4 and resumed there: the same losses step for
    step as an uninterrupted local run, every file in the bucket, and eval and generate
    read the run back from it."""
    from transformer_jax.train.config import ExperimentConfig, apply_overrides
    from transformer_jax.workdir import evaluate_workdir, load_run
    from transformer_jax.run import train

    cfg = apply_overrides(ExperimentConfig(), RUN + [f"data_dir={tmp_path / 'tfds'}"])
    local, remote = tmp_path / "local", f"{gcs}/run"
    want = train(cfg, local, progress=False)
    paused = train(cfg, remote, progress=False, stop_at=4)
    assert paused["paused"] and paused["final_step"] == 4
    got = train(cfg, remote, progress=False, resume=True)
    loss = lambda w: {r["step"]: r["loss"] for r in read_metrics(w) if "loss" in r}  # noqa: E731
    assert sorted(loss(remote)) == list(range(1, 9))
    np.testing.assert_array_equal([loss(remote)[s] for s in range(1, 9)],
                                  [loss(local)[s] for s in range(1, 9)])
    assert got["eval_loss"] == want["eval_loss"]
    run = storage.path(remote)
    assert json.loads(storage.read_text(run / "config.json"))["experiment"]["steps"] == 8
    assert storage.read_text(run / "samples.txt").count("=== step") == 2
    assert storage.read_bytes(run / "loss.png")[:4] == b"\x89PNG"
    assert list(run.glob("tb/events.out.tfevents.*"))
    run_config, model, params, task = load_run(remote)
    assert run_config["task_spec"]["tokenizer"] == "byte"
    assert evaluate_workdir(remote)["eval_loss"] == got["eval_loss"]
    greedy = dict(max_new_tokens=8, temperature=0.0, top_k=0, top_p=None, seed=0)
    _, lmodel, lparams, ltask = load_run(local)
    assert task.generate_text(model, params, "def ", **greedy) == \
        ltask.generate_text(lmodel, lparams, "def ", **greedy)


@pytest.mark.slow
def test_two_processes_train_into_one_bucket_and_resume_on_another_mesh(gcs, tmp_path):
    """2 processes (jax.distributed on localhost) write one gs:// workdir: process 0 the
    files, both the checkpoint shards; the run resumes there on another mesh."""
    from .test_sharding import _launch

    workdir, data_dir = f"{gcs}/multi", str(tmp_path / "tfds")
    outs = _launch(workdir, data_dir, 2, "data=4,fsdp=2")
    assert '"processes": 2' in outs[0] and '"processes": 2' not in outs[1]
    steps = sorted(int(p.name) for p in storage.path(f"{workdir}/checkpoints").iterdir()
                   if p.name.isdigit())
    assert steps == [2]
    _launch(workdir, data_dir, 4, "data=2,fsdp=2,tensor=2", "--resume")
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == [1, 2, 3, 4]
    assert storage.is_file(f"{workdir}/config.json") and storage.is_file(f"{workdir}/loss.png")


def test_staged_dir_gives_the_umask_modes_and_is_atomic(tmp_path):
    """A directory filled by ``staged_dir`` has the modes ``mkdir``/``open`` give under the
    umask (not mkdtemp's 0o700 nor a writer's 0o600), appears whole, and an exception leaves
    nothing."""
    old = os.umask(0o022)
    try:
        for mask, dir_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
            os.umask(mask)
            final = tmp_path / f"out{mask:o}"
            with storage.staged_dir(str(final)) as staging:
                assert not final.exists()
                os.mkdir(os.path.join(staging, "sub"), 0o700)
                for name in ("a.bin", "sub/b.json"):
                    os.close(os.open(os.path.join(staging, name), os.O_CREAT | os.O_WRONLY, 0o600))
            modes = {p.relative_to(final).as_posix(): p.stat().st_mode & 0o777
                     for p in [final, *final.rglob("*")]}
            assert modes == {".": dir_mode, "sub": dir_mode, "a.bin": file_mode,
                             "sub/b.json": file_mode}
        os.umask(0o022)
        with pytest.raises(RuntimeError):
            with storage.staged_dir(str(tmp_path / "failed")) as staging:
                (tmp_path / "failed_marker").write_text(staging)
                raise RuntimeError("stop")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["failed_marker", "out22", "out27"]
    finally:
        os.umask(old)
