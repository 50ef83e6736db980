"""The embedded default dataset: Python standard library source code.

``python_stdlib`` is a TensorFlow Datasets builder that needs no network: it
reads a fixed list of pure-Python module files from the standard library of the
*running* interpreter (``sysconfig.get_paths()["stdlib"]``) and writes them as
a TFDS dataset with one example per file::

    {"text": <the file's source code>, "path": <path relative to the stdlib>}

Splits (fixed, by file, deterministic):

* ``validation``: the 14 files in :data:`VALIDATION_FILES` (about 10% of the
  text).
* ``train``: the other 133 files of :data:`STDLIB_FILES`.

File list rule.  :data:`STDLIB_FILES` holds 147 module files that exist, as
plain files (not packages), in every CPython 3.10, 3.11, 3.12 and 3.13 standard
library; together they hold about 4.5 MB of UTF-8 text (4.4-4.7 MB depending on
the version).  Modules that were removed or turned into packages within that
range (``asyncore``, ``imp``, ``distutils``, ``re.py``, ``pathlib.py``,
``zipfile.py``, ``sysconfig.py``, ...) and modules that distributions ship
separately (``tkinter``, ``turtle``, ``idlelib``, ``lib2to3``) are not listed.
If a listed file is missing, building raises :class:`FileNotFoundError` naming
the file and the interpreter; no file is ever skipped silently, so a built
dataset always has exactly 147 examples.

Each interpreter version gets its own builder config (``py310`` ... ``py314``;
the default is the running interpreter's), so datasets built by different
interpreters never share a directory.  The text of a file can still differ
between patch releases of the same minor version; the data is read once, when
the dataset is prepared.

The builder writes the ``array_record`` file format, which TFDS reads with
``tfds.data_source`` without TensorFlow; preparing it downloads nothing.

Example::

    import tensorflow_datasets as tfds
    from transformer_jax.data import stdlib_corpus  # registers the builder

    source = tfds.data_source("python_stdlib", split="train",
                              data_dir="/tmp/tfds")
    source[0]["text"]  # bytes of one module's source
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

import tensorflow_datasets as tfds
from etils import epath

from transformer_jax.errors import UserError

__all__ = [
    "DATASET_NAME",
    "STDLIB_FILES",
    "TRAIN_FILES",
    "VALIDATION_FILES",
    "PythonStdlib",
    "file_list_digest",
    "default_stdlib_dir",
]

#: The name under which the builder is registered in TFDS.
DATASET_NAME = "python_stdlib"

#: Paths, relative to the standard library directory, of the 147 module files
#: in the dataset, sorted.  Present in CPython 3.10, 3.11, 3.12 and 3.13.
STDLIB_FILES: tuple[str, ...] = (
    "__future__.py",
    "_collections_abc.py",
    "_markupbase.py",
    "_strptime.py",
    "_threading_local.py",
    "_weakrefset.py",
    "abc.py",
    "argparse.py",
    "ast.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
    "asyncio/futures.py",
    "asyncio/locks.py",
    "asyncio/queues.py",
    "asyncio/selector_events.py",
    "asyncio/streams.py",
    "asyncio/tasks.py",
    "base64.py",
    "bdb.py",
    "bisect.py",
    "bz2.py",
    "calendar.py",
    "cmd.py",
    "code.py",
    "codecs.py",
    "codeop.py",
    "collections/__init__.py",
    "compileall.py",
    "concurrent/futures/_base.py",
    "concurrent/futures/process.py",
    "concurrent/futures/thread.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "copyreg.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "email/feedparser.py",
    "email/generator.py",
    "email/header.py",
    "email/message.py",
    "email/utils.py",
    "enum.py",
    "filecmp.py",
    "fileinput.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "genericpath.py",
    "getopt.py",
    "gettext.py",
    "glob.py",
    "graphlib.py",
    "gzip.py",
    "hashlib.py",
    "heapq.py",
    "hmac.py",
    "html/parser.py",
    "http/client.py",
    "http/server.py",
    "importlib/_bootstrap.py",
    "importlib/_bootstrap_external.py",
    "importlib/util.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "linecache.py",
    "locale.py",
    "logging/__init__.py",
    "logging/config.py",
    "logging/handlers.py",
    "lzma.py",
    "mimetypes.py",
    "modulefinder.py",
    "multiprocessing/connection.py",
    "multiprocessing/pool.py",
    "multiprocessing/process.py",
    "multiprocessing/queues.py",
    "multiprocessing/synchronize.py",
    "netrc.py",
    "ntpath.py",
    "numbers.py",
    "operator.py",
    "optparse.py",
    "os.py",
    "pdb.py",
    "pickle.py",
    "pkgutil.py",
    "platform.py",
    "plistlib.py",
    "posixpath.py",
    "pprint.py",
    "profile.py",
    "pstats.py",
    "py_compile.py",
    "pyclbr.py",
    "queue.py",
    "quopri.py",
    "random.py",
    "reprlib.py",
    "rlcompleter.py",
    "runpy.py",
    "sched.py",
    "secrets.py",
    "selectors.py",
    "shelve.py",
    "shlex.py",
    "shutil.py",
    "socket.py",
    "socketserver.py",
    "ssl.py",
    "stat.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "symtable.py",
    "tabnanny.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "timeit.py",
    "tokenize.py",
    "trace.py",
    "traceback.py",
    "tracemalloc.py",
    "types.py",
    "typing.py",
    "unittest/case.py",
    "unittest/loader.py",
    "unittest/mock.py",
    "unittest/result.py",
    "urllib/parse.py",
    "urllib/request.py",
    "uuid.py",
    "warnings.py",
    "wave.py",
    "weakref.py",
    "webbrowser.py",
    "xml/dom/minidom.py",
    "xml/etree/ElementTree.py",
    "xmlrpc/client.py",
    "zipapp.py",
    "zipimport.py",
)

#: The held-out files (the ``validation`` split), a subset of STDLIB_FILES.
VALIDATION_FILES: tuple[str, ...] = (
    "argparse.py",
    "asyncio/locks.py",
    "calendar.py",
    "csv.py",
    "fractions.py",
    "gzip.py",
    "heapq.py",
    "json/encoder.py",
    "logging/handlers.py",
    "queue.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "urllib/parse.py",
)

#: The ``train`` split: every listed file that is not held out, sorted.
TRAIN_FILES: tuple[str, ...] = tuple(
    f for f in STDLIB_FILES if f not in frozenset(VALIDATION_FILES)
)

_SPLIT_FILES = {"train": TRAIN_FILES, "validation": VALIDATION_FILES}

# Interpreter versions that get a builder config of their own.
_KNOWN_VERSIONS = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))


def file_list_digest(files: tuple[str, ...] = STDLIB_FILES) -> str:
    """Returns a stable SHA-256 hex digest of a file list.

    The digest is taken over the sorted names joined by newlines, so it
    identifies the list's content regardless of its order; tests use it to
    check that the list stays fixed.
    """
    return hashlib.sha256("\n".join(sorted(files)).encode("utf-8")).hexdigest()


def default_stdlib_dir() -> str:
    """Returns the standard library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _config_name(version: tuple[int, int]) -> str:
    return f"py{version[0]}{version[1]}"


def _builder_configs() -> list[tfds.core.BuilderConfig]:
    versions = list(_KNOWN_VERSIONS)
    running = tuple(sys.version_info[:2])
    if running not in versions:
        versions.append(running)
    return [
        tfds.core.BuilderConfig(
            name=_config_name(v),
            description=f"Standard library source of CPython {v[0]}.{v[1]}.",
        )
        for v in versions
    ]


def _read_source(path: str) -> str:
    # newline="" keeps the file's line endings exactly as they are on disk.
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
    """TFDS builder over the running interpreter's standard library source.

    Registered as ``python_stdlib``.  Examples are ``{"text", "path"}`` string
    features; splits ``train`` and ``validation`` are fixed by file (see the
    module docstring for the file-list rule).

    Args (besides TFDS's usual ``data_dir``, ``config``, ...):
      stdlib_dir: read the files from this directory instead of the running
        interpreter's standard library (used to test the missing-file error).
        Only the running interpreter's config can be built.

    Unless ``file_format`` is given, the builder writes ``array_record``.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: 147 files, train/validation."}
    BUILDER_CONFIGS = _builder_configs()
    DEFAULT_BUILDER_CONFIG_NAME = _config_name(tuple(sys.version_info[:2]))
    # TFDS derives this file's path through importlib resources, which in
    # tensorflow-datasets 4.9.x needs the `importlib_resources` backport for
    # builders defined outside its own package; giving the path directly
    # avoids that.  TFDS only uses it to look for a checksums file (there is
    # none: nothing is downloaded).
    code_path = epath.Path(__file__)

    def __init__(self, *, stdlib_dir: str | None = None, **kwargs):
        kwargs.setdefault("file_format", "array_record")
        self._stdlib_dir = stdlib_dir
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Source code of 147 pure-Python modules of the CPython standard "
                "library, one example per file, split by file into train and "
                "validation. Built locally from the running interpreter."
            ),
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "path": tfds.features.Text()}
            ),
            homepage="https://docs.python.org/3/library/",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing is downloaded.
        running = _config_name(tuple(sys.version_info[:2]))
        if self.builder_config.name != running:
            raise UserError(
                f"python_stdlib config {self.builder_config.name!r} can only be "
                f"built by that Python version; this interpreter is {running!r}."
            )
        root = self._stdlib_dir or default_stdlib_dir()
        missing = [f for f in STDLIB_FILES if not os.path.isfile(os.path.join(root, f))]
        if missing:
            raise UserError(
                f"python_stdlib: file {missing[0]!r} of the fixed file list is "
                f"missing from {root!r} (Python {sys.version.split()[0]}); "
                f"{len(missing)} file(s) missing in all: {missing}. The dataset "
                "needs every listed file; use a standard CPython 3.10-3.13 "
                "installation."
            )
        return {
            split: self._generate_examples(root, files)
            for split, files in _SPLIT_FILES.items()
        }

    def _generate_examples(self, root: str, files: tuple[str, ...]):
        for relative_path in files:
            text = _read_source(os.path.join(root, relative_path))
            yield relative_path, {"text": text, "path": relative_path}
