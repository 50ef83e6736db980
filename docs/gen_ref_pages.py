"""Writes the API reference: one page per public module of transformer_jax/, and its nav.

Run by the mkdocs-gen-files plugin at build time (mkdocs.yml), so a module added, moved or
removed under transformer_jax/ changes the reference with no hand edit. Private modules
(a name starting with ``_``, other than ``__init__``) are skipped. Each page is one
mkdocstrings directive (``::: transformer_jax.x.y``); mkdocstrings reads the source
statically (griffe), so nothing is imported and torch is never loaded.
"""
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "transformer_jax"

nav = mkdocs_gen_files.Nav()
for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if any(part.startswith("_") and part != "__init__" for part in parts):
        continue                                    # private modules stay out of the reference
    if parts[-1] == "__init__":
        parts = parts[:-1]
        doc_path = Path(*parts, "index.md")
    else:
        doc_path = Path(*parts).with_suffix(".md")
    nav[parts] = doc_path.as_posix()
    with mkdocs_gen_files.open(Path("reference", doc_path), "w") as page:
        page.write(f"# `{'.'.join(parts)}`\n\n::: {'.'.join(parts)}\n")
    mkdocs_gen_files.set_edit_path(Path("reference", doc_path), path.relative_to(ROOT))

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as summary:
    summary.writelines(nav.build_literate_nav())
