"""The manual stays true: the config reference is the generated one, the docs build strictly
(no broken link, no page outside the navigation), and the README stays a short front page whose
links land."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rayppo.config.reference_page import reference_markdown
from rayppo.config.schema import field_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_LINES = 200
"""The README is a front page: what rayppo is, the two commands, what you see, where to read on."""


def _mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, env=env, timeout=300)


def test_config_reference_page_is_the_generated_one():
    page = (DOCS / "config.md").read_text()
    missing = [name for name, _, _ in field_docs() if f"`{name}`" not in page]
    assert missing == [], f"docs/config.md lacks {missing}"
    assert page == reference_markdown(), "docs/config.md is stale: rayppo config --markdown > docs/config.md"


def test_docs_build_strict(tmp_path):
    result = _mkdocs_build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "config" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link_and_an_orphan_page(tmp_path):
    """The check above can fail: the same docs with one broken link, or one page missing from the
    navigation, do not build."""
    for breakage in ("link", "orphan"):
        copy = tmp_path / breakage
        shutil.copytree(DOCS, copy / "docs")
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        if breakage == "link":
            with open(copy / "docs" / "failures.md", "a") as f:
                f.write("\nSee [the old page](resuming.md).\n")
        else:
            (copy / "docs" / "orphan.md").write_text("# Not in the navigation\n")
        result = _mkdocs_build(copy, copy / "site")
        assert result.returncode != 0, breakage
        assert ("resuming.md" if breakage == "link" else "orphan.md") in result.stderr


def test_readme_is_short_and_its_links_land():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    links = re.findall(r"\]\(([^)#\s]+)[^)]*\)", readme)
    broken = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert broken == []
    nav_pages = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    assert nav_pages == {p.name for p in DOCS.glob("*.md")}
    unlinked = sorted(p for p in nav_pages - {"index.md"} if f"docs/{p}" not in links)
    assert unlinked == [], f"the README's manual table lacks {unlinked}"


def test_quick_start_targets_exist_and_ci_runs_the_test_command():
    makefile = (ROOT / "Makefile").read_text()
    assert "\ntrain:" in makefile and "\ntest:" in makefile
    assert "make train" in (ROOT / "README.md").read_text() and "make test" in (ROOT / "README.md").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()
