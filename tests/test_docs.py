"""The README stays true: its config reference covers every field, its commands exist."""

from pathlib import Path

from rayppo.config.schema import field_docs

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_reference_lists_every_field():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name, _, _ in field_docs() if f"`{name}`" not in readme]
    assert missing == [], f"README config reference lacks {missing}; regenerate it from `rayppo config`"


def test_quick_start_targets_exist_and_ci_runs_the_test_command():
    makefile = (ROOT / "Makefile").read_text()
    assert "\ntrain:" in makefile and "\ntest:" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()
