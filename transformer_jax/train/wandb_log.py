"""Weights & Biases logging (``--set log.wandb=true``): what metrics.jsonl holds, in a W&B run.

:class:`WandbLog` is the W&B side of :class:`~transformer_jax.train.monitor.MetricsWriter`:
the run config (config.json's) is the W&B run's config; every row of metrics.jsonl (the
logged steps, the evals) is logged at its step, under its metrics.jsonl names; each eval's
sample as ``wandb.Html`` (key ``sample``); the loss curve (loss.png) as ``wandb.Image`` (key
``loss_curve``) at the end. TensorBoard and metrics.jsonl are written as always; only
process 0 logs. ``wandb`` is the ``wandb`` extra: without it a run with ``log.wandb`` is
refused (:func:`require_wandb`) before anything is written.

Files: W&B's directory is ``workdir/wandb/`` (for a workdir in a bucket, a local
``$TMPDIR/transformer_jax_wandb/<workdir name>/wandb/``); ``workdir/wandb/run_id`` holds the W&B
run's id, so that a resumed run (``--resume``) continues the same W&B run
(``resume="allow"``); a fresh run starts a new one. Rows a resumed online run has logged
already (its steps up to the crash, the same values) are not sent twice.

Mode (``log.wandb_mode``, else ``$WANDB_MODE``): "online" where an API key is set up
(``$WANDB_API_KEY``, or ``wandb login``'s netrc entry), else "offline": nothing goes over
the network, the run is kept in its directory, and one line names it and the ``wandb sync``
command that uploads it later. W&B itself prints nothing (``silent``) and leaves stdout
alone (``console="off"``).

Online, W&B's server (``$WANDB_BASE_URL``, default https://api.wandb.ai) is asked once
before the run writes anything (:func:`choose_mode`; :data:`PROBE_SECONDS`), instead of
``wandb.init`` waiting its ``init_timeout`` (90 s) and failing after the run has started.
Where it does not answer, a mode the user chose (``log.wandb_mode=online`` or
``WANDB_MODE=online``) is one error line, and the online mode an API key implied becomes
offline with one warning: the run trains and is kept for ``wandb sync``, as W&B keeps an
offline run.
"""
from __future__ import annotations

import html
import io
import netrc
import os
import secrets
import string
import tempfile
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from .. import storage
from ..errors import UserError
from .config import LogConfig

#: how to get the package, in the error that says it is missing
INSTALL = "pip install -e '.[wandb]' (or pip install wandb)"


def require_wandb(log: LogConfig):
    """The ``wandb`` module when ``log.wandb`` is on (None when off); a UserError saying
    how to install it when it cannot be imported."""
    if not log.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError(f"log.wandb=true logs to Weights & Biases, but wandb is not installed; "
                        f"{INSTALL}, or drop --set log.wandb=true") from None
    return wandb


def has_api_key() -> bool:
    """Whether W&B credentials are set up: ``$WANDB_API_KEY``, or a netrc entry for the
    W&B host (``$WANDB_BASE_URL``, default api.wandb.ai) as ``wandb login`` writes it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(log: LogConfig) -> str:
    """``log.wandb_mode``, else ``$WANDB_MODE``, else online with an API key, offline without."""
    chosen = log.wandb_mode or os.environ.get("WANDB_MODE")
    return chosen or ("online" if has_api_key() else "offline")


#: seconds W&B's server has to answer one request before it counts as unreachable
PROBE_SECONDS = 3.0
#: the modes in which ``wandb.init`` talks to the server
ONLINE_MODES = ("online", "run", "shared")


def server_url() -> str:
    """W&B's server: ``$WANDB_BASE_URL``, default https://api.wandb.ai."""
    return (os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").rstrip("/")


def unreachable(url: str, timeout: float = PROBE_SECONDS) -> str | None:
    """Why ``url`` cannot be reached, or None where it answers (any HTTP status counts):
    one request, no retries (proxies from the environment, as W&B's client takes them)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:     # URLError and timeouts are OSErrors
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}"
    return None


def choose_mode(log: LogConfig, say: Callable[[str], None]) -> str:
    """The mode the run logs in (:func:`resolve_mode`), decided before anything is written:
    online, where W&B's server does not answer (:func:`unreachable`), a mode the user chose
    is refused (UserError) and the one an API key implied becomes "offline", ``say`` getting
    the one line that says so."""
    mode = resolve_mode(log)
    if mode not in ONLINE_MODES:
        return mode
    url = server_url()
    why = unreachable(url)
    if why is None:
        return mode
    chosen = (f"log.wandb_mode={log.wandb_mode}" if log.wandb_mode else
              f"WANDB_MODE={os.environ['WANDB_MODE']}" if os.environ.get("WANDB_MODE") else None)
    if chosen:
        raise UserError(f"{chosen} logs to W&B at {url}, which cannot be reached ({why}); log "
                        "offline and upload later with `wandb sync` (--set log.wandb_mode=offline), "
                        "or drop --set log.wandb=true")
    say(f"W&B at {url} cannot be reached ({why}): logging offline instead, for `wandb sync` to "
        "upload later (--set log.wandb_mode=offline chooses that, log.wandb_mode=online refuses "
        "to start instead)")
    return "offline"


def wandb_run_mode(log: LogConfig, main: bool, say: Callable[[str], None]) -> str | None:
    """What a run checks of W&B before it writes anything: the package
    (:func:`require_wandb`) on every process, and on the ``main`` one the mode it logs in
    (:func:`choose_mode`); None without ``log.wandb`` or off the main process."""
    if require_wandb(log) is None or not main:
        return None
    return choose_mode(log, say)


def local_dir(workdir) -> Path:
    """The directory W&B's own ``wandb/`` goes in: the workdir, or a local one for a bucket."""
    if storage.is_remote(workdir):
        return Path(tempfile.gettempdir()) / "transformer_jax_wandb" / storage.path(workdir).name
    return Path(workdir)


def _new_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLog:
    """One W&B run, fed by the run's :class:`~transformer_jax.train.monitor.MetricsWriter`."""

    def __init__(self, run, wandb_module):
        self.run, self.wandb = run, wandb_module
        self.last_step = 0

    @classmethod
    def open(cls, log: LogConfig, workdir, run_config: dict[str, Any], *, resumed: bool,
             say: Callable[[str], None] = print, mode: str | None = None) -> WandbLog:
        """Start (or, ``resumed``, continue) the W&B run of ``workdir``, in ``mode`` (None:
        :func:`resolve_mode`'s; a run passes :func:`choose_mode`'s); ``say`` gets the one
        line that says where it logs."""
        wandb = require_wandb(log)
        workdir = storage.path(workdir)
        id_file = workdir / "wandb" / "run_id"
        run_id = storage.read_text(id_file).strip() if resumed and storage.is_file(id_file) else ""
        run_id = run_id or _new_id()
        mode = mode or resolve_mode(log)
        directory = local_dir(workdir)
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode=mode, silent=True, console="off", save_code=False,
                                  disable_job_creation=True)
        try:
            # the process-wide settings too: W&B's own telemetry follows them, not the run's
            # (offline, it would still look for its server)
            wandb.setup(settings=settings)
            run = wandb.init(project=log.wandb_project, name=log.wandb_run_name or workdir.name,
                             id=run_id, resume="allow", mode=mode, dir=os.fspath(directory),
                             config=run_config, settings=settings)
        except Exception as e:   # noqa: BLE001 - wandb's errors (login, network, mode) in one line
            raise UserError(f"W&B did not start a run in mode {mode!r} ({type(e).__name__}: {e}); "
                            "run `wandb login`, or log without network with --set "
                            "log.wandb_mode=offline, or drop --set log.wandb=true") from None
        storage.write_text(id_file, run_id + "\n")
        if mode == "offline":
            where = run.settings.sync_dir
            say(f"wandb: offline run in {where}; sync with: wandb sync {where}")
        else:
            say(f"wandb: logging to {run.url or run.settings.sync_dir}")
        return cls(run, wandb)

    def write(self, step: int, row: dict[str, Any]) -> None:
        """A metrics.jsonl row (without ``step``) at ``step``; a step the W&B run holds
        already (a resumed online run's, logged before the crash) is skipped."""
        if step < self.run.step:
            return
        self.run.log(row, step=step)
        self.last_step = step

    def text(self, tag: str, step: int, text: str) -> None:
        if step >= self.run.step:
            self.run.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>",
                                                   inject=False)}, step=step)

    def image(self, tag: str, png) -> None:
        """The PNG at ``png`` (local or in a bucket) at the last logged step."""
        from PIL import Image

        picture = Image.open(io.BytesIO(storage.read_bytes(png)))
        self.run.log({tag: self.wandb.Image(picture)}, step=max(self.last_step, self.run.step))

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
