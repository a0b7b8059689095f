"""The docs site builds in MkDocs' strict mode (a broken link, or a page left out of the navigation,
fails it), and the configuration reference is the settings table's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(where: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the site configured in ``where`` (warnings are not silenced: in
    strict mode they are what fails the build)."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_docs_site_builds_strictly(tmp_path):
    proc = build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "serving" / "configuration" / "index.html").exists()


def test_the_configuration_reference_is_the_settings_table():
    from racer import settings_doc

    assert settings_doc.main(["--check"]) == 0, "docs/serving/configuration.md is stale: python -m racer.settings_doc"
    text = settings_doc.render()
    assert "`RACER_PORTS_FILE`" in text and "`--kv-memory-bytes`" in text  # every service's table is in it


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The negative control: a page linking to a missing page does not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nstrict: true\nnav:\n  - index.md\n")
    proc = build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "missing.md" in proc.stdout + proc.stderr
