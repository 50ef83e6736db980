"""The documentation site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict``.

Strict mode turns every warning into an error, so the build fails on a link to a page or
anchor that does not exist, on a ``docs/`` page left out of the nav, and on a
cross-reference (``[name][transformer_jax.module.function]``) to an object that moved or was
renamed. The API reference is generated from the docstrings by ``docs/gen_ref_pages.py``
(mkdocstrings reads the source statically: nothing is imported). The full build takes about
10-20 s on 2 cores; the failure cases build a reduced site (the same validation rules and
hooks, no API reference) in a second or two. The docstrings' own Sphinx-style references
(``:func:`transformer_jax...```), which the site renders as text, are checked by importing
what they name.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

for _name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "mkdocs_gen_files",
              "mkdocs_literate_nav", "mkdocs_autorefs"):
    pytest.importorskip(_name, reason="needs the docs extra: pip install -e '.[docs]'")
import yaml  # noqa: E402  (mkdocs depends on PyYAML)

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m mkdocs build --strict`` of ``config`` into ``site``."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(REPO / "mkdocs.yml", out, REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_the_site_builds_strict_with_every_docs_page(site):
    pages = sorted(p.stem for p in DOCS.glob("*.md"))
    assert "index" in pages and "architecture" in pages
    for stem in pages:
        built = site / ("index.html" if stem == "index" else f"{stem}/index.html")
        assert built.is_file(), f"docs/{stem}.md is not in the built site"


def test_the_api_reference_is_generated_from_the_docstrings(site):
    page = (site / "reference/transformer_jax/losses/index.html").read_text()
    assert "label_smoothed_cross_entropy" in page
    assert "Cross-entropy" in page or "cross-entropy" in page      # its docstring's text
    assert ":data:" not in page and "<code>LossFn</code>" in page   # Sphinx roles as code
    for module in ("layers/attention", "models/gpt", "train/step", "data"):
        assert (site / "reference/transformer_jax" / module / "index.html").is_file(), module
    private = [p for p in (site / "reference").rglob("*") if p.name.startswith("_")]
    assert not private, private


def test_the_architecture_page_links_into_the_api_reference(site):
    page = (site / "architecture/index.html").read_text()
    assert re.search(r'href="[^"]*reference/transformer_jax/losses/#transformer_jax\.losses\.lm_loss"', page)


def reduced_site(tmp_path: Path, page: str) -> Path:
    """A two-page site under the real config's validation rules and hooks, without the
    generated API reference (fast): ``extra.md`` (``page``) and ``target.md``, whose one
    section is ``#a-section``."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "extra.md").write_text(page)
    (docs / "target.md").write_text("# Target\n\n## A section\n\nText.\n")
    hooks = tmp_path / "hooks.py"
    shutil.copy(DOCS / "mkdocs_hooks.py", hooks)
    config.update(docs_dir=str(docs), hooks=[str(hooks)], plugins=["autorefs"], exclude_docs="",
                  nav=[{"Extra": "extra.md"}, {"Target": "target.md"}])
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_reduced_copy_builds(tmp_path):
    """The control for the failure cases below; and text that only looks like a reference
    (command-line usage, token names) does not fail the build."""
    config = reduced_site(tmp_path, "# Extra\n\nSee [a section](target.md#a-section). Usage: [--workdir DIR] "
                                    "[--steps N]; [CLS] a [SEP] b [SEP]\n")
    result = build(config, tmp_path / "site", tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


def test_a_link_to_a_missing_page_fails_the_build(tmp_path):
    config = reduced_site(tmp_path, "# Extra\n\nSee [the old page](no_such_page.md).\n")
    result = build(config, tmp_path / "site", tmp_path)
    assert result.returncode != 0
    assert "no_such_page.md" in result.stderr


def test_a_link_to_a_missing_anchor_fails_the_build(tmp_path):
    config = reduced_site(tmp_path, "# Extra\n\nSee [it](target.md#no-such-section).\n")
    result = build(config, tmp_path / "site", tmp_path)
    assert result.returncode != 0
    assert "no-such-section" in result.stderr


def test_a_stale_reference_to_an_object_fails_the_build(tmp_path):
    config = reduced_site(tmp_path, "# Extra\n\n[`train`][transformer_jax.train.no_such_module.train]\n")
    result = build(config, tmp_path / "site", tmp_path)
    assert result.returncode != 0
    assert "transformer_jax.train.no_such_module.train" in result.stderr


ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj):`~?(transformer_jax(?:\.\w+)+)`")


def _resolve(target: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(target)


def test_docstring_references_name_objects_that_exist():
    """Sphinx-style references in the source (``:func:`transformer_jax.train.loop.train```)
    name an object that exists: a module moved or a function renamed fails here, naming the
    file and line that still cite the old path."""
    stale, checked = [], 0
    for path in sorted((REPO / "transformer_jax").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for target in ROLE.findall(line):
                checked += 1
                try:
                    _resolve(target)
                except (ImportError, AttributeError) as e:
                    stale.append(f"{path.relative_to(REPO)}:{lineno}: {target} ({e})")
    assert checked > 40, checked      # the pattern still finds the references
    assert not stale, "\n".join(stale)
    with pytest.raises(AttributeError):
        _resolve("transformer_jax.losses.no_such_function")
