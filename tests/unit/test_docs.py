"""The docs site builds without a warning (mkdocs.yml: the pages under docs/ and the API
reference mkdocstrings makes from the docstrings), as CI builds it."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs and test extras install mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # (mkdocs-material's notice, not a warning)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (tmp_path / "site" / "api" / "group" / "index.html").exists()


def test_the_api_reference_names_every_public_name():
    """Each name of ctrlcomm.__all__ has a ``::: ctrlcomm.NAME`` entry under docs/api/."""
    import ctrlcomm

    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    missing = [n for n in ctrlcomm.__all__ if f"::: ctrlcomm.{n}\n" not in pages]
    assert not missing, f"add them to a page under docs/api/: {missing}"
