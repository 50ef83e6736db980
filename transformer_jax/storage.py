"""One path layer for every file a run reads or writes, on a local disk or in a bucket.

Workdirs, checkpoints, ``config.json``, ``metrics.jsonl``, TensorBoard events, samples, the
loss plot and tokenizer models all go through ``etils.epath`` (which orbax and TFDS use as
well), so ``--workdir gs://bucket/run`` works like a local directory and every host of a pod
sees the same files. Object stores cannot append to or rename an object: :func:`append_text`
rewrites it, :class:`TextLog` keeps the text in memory and rewrites it on flush, and each
write replaces the whole object at once (atomic; local writes go through a temporary file).

**GCS emulator.** ``STORAGE_EMULATOR_HOST`` (the variable Google's own clients read), e.g.
``STORAGE_EMULATOR_HOST=http://127.0.0.1:9023``, is the one switch that sends every gs://
request to a local GCS JSON API server (such as the ``gcp-storage-emulator`` package) instead
of Google. gcsfs (behind epath) reads it itself; :func:`configure_emulator` maps it to
tensorstore's ``TENSORSTORE_GCS_HTTP_URL`` (orbax writes arrays with tensorstore), gives
tensorstore a fixed token (``GOOGLE_AUTH_TOKEN_FOR_TESTING``) and gcsfs anonymous access, so
neither looks for credentials, turns off gcsfs's gRPC bucket-type probe
(``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``), which an emulator does not answer, and keeps
epath on gcsfs where TensorFlow is installed (``EPATH_USE_TF=false``; TensorFlow's own GCS
client would bypass the emulator). It runs when this module is imported and again whenever
a path is made, so setting the variable before a run starts is enough.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from etils import epath

from .errors import UserError

__all__ = ["path", "is_remote", "exists", "is_file", "is_dir", "makedirs", "read_text",
           "read_bytes", "write_text", "write_bytes", "append_text", "TextLog", "staged_dir",
           "configure_emulator", "emulator_url"]

PathLike = Any   # str | os.PathLike | epath.Path


# ----------------------------------------------------------------------------- emulator switch

_applied_url: str | None = None    # the emulator the clients were last pointed at
_set_by_us: dict[str, str] = {}    # environment variables this module set, to undo them


def emulator_url() -> str | None:
    """``STORAGE_EMULATOR_HOST`` as a URL (``http://`` added when missing), or None when unset."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host in ("", "default"):
        return None
    return host if "://" in host else f"http://{host}"


def configure_emulator() -> str | None:
    """Points tensorstore and gcsfs at ``STORAGE_EMULATOR_HOST`` (or back at GCS when unset).

    Cheap when nothing changed. Returns the emulator URL, or None.
    """
    global _applied_url
    url = emulator_url()
    if url == _applied_url:
        return url
    for name in list(_set_by_us):   # undo the previous emulator's settings
        if os.environ.get(name) == _set_by_us.pop(name):
            os.environ.pop(name, None)
    if url is not None:
        wanted = {"TENSORSTORE_GCS_HTTP_URL": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                  "EPATH_USE_TF": "false"}
        if "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in os.environ:
            wanted["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
        for name, value in wanted.items():
            os.environ[name] = value
            _set_by_us[name] = value
    _point_gcsfs(anonymous=url is not None)
    _applied_url = url
    return url


def _point_gcsfs(anonymous: bool) -> None:
    """gcsfs: anonymous access and the plain (HTTP only) file system for an emulator; drops
    the file-system instances that fsspec and epath cached, so the next call sees the switch."""
    import fsspec

    conf = fsspec.config.conf
    if anonymous:
        conf.setdefault("gcs", {})["token"] = "anon"
        conf.setdefault("gs", {})["token"] = "anon"
    else:
        for proto in ("gcs", "gs"):
            if conf.get(proto, {}).get("token") == "anon":
                conf[proto].pop("token")
    if "gcsfs" in sys.modules:   # imported before the switch was read: pick the class again
        import gcsfs
        from gcsfs.core import GCSFileSystem

        cls = GCSFileSystem if anonymous else gcsfs.GCSFileSystem
        for proto in ("gs", "gcs"):
            fsspec.register_implementation(proto, cls, clobber=True)
        GCSFileSystem.clear_instance_cache()
        gcsfs.GCSFileSystem.clear_instance_cache()
    from etils.epath import backend, gpath   # epath keeps one file system per scheme

    cached = getattr(getattr(backend, "_FileSystemSpecBackend", None), "_get_filesystem", None)
    for memo in (cached, getattr(gpath, "_is_tf_installed", None)):   # and whether to use TF
        if hasattr(memo, "cache_clear"):
            memo.cache_clear()


# ----------------------------------------------------------------------------- paths

def path(p: PathLike) -> epath.Path:
    """``epath.Path`` for ``p``: URLs (gs://...) as they are, local paths made absolute."""
    configure_emulator()
    text = os.fspath(p)
    if "://" in text:
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


def is_remote(p: PathLike) -> bool:
    """Whether ``p`` names an object store (``gs://``, ``s3://``...) rather than a local path."""
    return "://" in os.fspath(p)


def exists(p: PathLike) -> bool:
    return path(p).exists()


def is_file(p: PathLike) -> bool:
    return path(p).is_file()


def is_dir(p: PathLike) -> bool:
    return path(p).is_dir()


def makedirs(p: PathLike) -> epath.Path:
    """Creates directory ``p`` and its parents. In a bucket directories are implicit, so this
    only checks that the bucket exists (a clear error up front, not at the first save)."""
    p = path(p)
    if not is_remote(p):
        p.mkdir(parents=True, exist_ok=True)
        return p
    scheme, rest = os.fspath(p).split("://", 1)
    bucket = epath.Path(f"{scheme}://{rest.split('/', 1)[0]}")
    if not bucket.exists():
        raise UserError(f"bucket {bucket} does not exist (or is not readable with these "
                        f"credentials); create it (gcloud storage buckets create {bucket}) "
                        "or choose a --workdir in a bucket you can write to")
    return p


# errnos of a failed write that the user fixes: space, quota, a read-only disk, permissions,
# a file-size limit (the CLI prints them as one line; checkpoint saves name them)
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def check_workdir(p: PathLike) -> None:
    """A UserError unless ``p`` is a directory this process can write to, or can be created:
    names a path that is a file, or the OS error of a read-only, full or forbidden disk.
    Checked before a run writes anything (it writes, then removes, one unnamed temporary
    file). Buckets are checked by :func:`makedirs`."""
    p = path(p)
    if is_remote(p):
        return
    if p.exists() and not p.is_dir():
        raise UserError(f"--workdir {p} is a file, not a directory; give the path of a "
                        "directory (it is created if missing)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--workdir {p} cannot be created: {existing} is a file; choose a path "
                        "under a directory")
    try:
        with tempfile.TemporaryFile(dir=os.fspath(existing)) as probe:
            probe.write(b"x")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        raise UserError(f"cannot write to {existing} ({e.strerror}); choose a --workdir on a "
                        "writable disk with free space, or fix its permissions") from None


# ----------------------------------------------------------------------------- whole files

def read_bytes(p: PathLike) -> bytes:
    return path(p).read_bytes()


def read_text(p: PathLike) -> str:
    return read_bytes(p).decode("utf-8")


def write_bytes(p: PathLike, data: bytes) -> None:
    """Replaces ``p`` with ``data`` at once: readers see the old or the new content, never a
    part (locally a temporary file renamed over ``p``; an object is written whole)."""
    p = path(p)
    if is_remote(p):
        with p.open("wb") as f:
            f.write(data)
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.tmp{os.getpid()}"
    tmp.write_bytes(data)
    os.replace(tmp, p)


def write_text(p: PathLike, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


def append_text(p: PathLike, text: str) -> None:
    """Appends ``text`` to ``p`` (created if missing). An object cannot be appended to, so in
    a bucket this reads the object and writes it back: for files appended to now and then
    (samples at each eval); a stream of rows wants :class:`TextLog`."""
    p = path(p)
    if not is_remote(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a") as f:
            f.write(text)
        return
    old = p.read_bytes() if p.exists() else b""
    write_bytes(p, old + text.encode("utf-8"))


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)        # elsewhere: set and restore it at once
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_dir(final: str):
    """A new local directory ``final``, filled out of sight: yields a temporary sibling to
    write in; then gives it and everything under it the modes a plain ``mkdir``/``open``
    would (0o777 / 0o666 less the umask: ``tempfile.mkdtemp`` makes 0o700, safetensors
    writes 0o600) and renames it to ``final`` (an empty directory there is replaced). On an
    exception the sibling is removed and ``final`` is left as it was."""
    parent = os.path.dirname(os.path.abspath(final)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(final))}-", dir=parent)
    try:
        yield staging
        mask = umask()
        for root, dirs, files in os.walk(staging):
            os.chmod(root, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
        if os.path.isdir(final):
            os.rmdir(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class TextLog:
    """A text file that grows by appended rows (``metrics.jsonl``).

    Locally each :meth:`append` goes straight to the file. In a bucket the whole text is kept
    in memory and the object rewritten by :meth:`flush`, which :meth:`append` calls at most
    every ``flush_secs`` and :meth:`close` calls last; call it before a checkpoint so that
    the rows up to it are stored with it.

    Args:
      p: the file.
      text: its content so far (what the caller kept of an existing file); it replaces
        whatever ``p`` holds.
      flush_secs: the longest a row waits in memory (bucket only).
    """

    def __init__(self, p: PathLike, text: str = "", *, flush_secs: float = 30.0):
        self.path = path(p)
        self.remote = is_remote(self.path)
        self.flush_secs = flush_secs
        self._buffer = io.StringIO()
        self._buffer.write(text)
        self._dirty = False
        write_text(self.path, text)
        self._last_flush = time.monotonic()

    def append(self, text: str) -> None:
        if not self.remote:
            with self.path.open("a") as f:
                f.write(text)
            return
        self._buffer.write(text)
        self._dirty = True
        if time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def flush(self) -> None:
        if self.remote and self._dirty:
            write_text(self.path, self._buffer.getvalue())
            self._dirty = False
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()


configure_emulator()
