"""The config reference page (``docs/config.md``), generated from the dataclass docstrings:

    rayppo config --markdown > docs/config.md

The test suite compares the committed page with this output, so a field added or reworded
without regenerating the page fails CI."""

from __future__ import annotations

from rayppo.config.schema import Config, field_docs

INTRO = """\
# Config reference

Every field of the one config tree, its default and its meaning, generated from the dataclass
docstrings in `rayppo/config/schema.py` (`rayppo config` prints the same in the terminal;
regenerate this page with `rayppo config --markdown > docs/config.md`). Set fields in a YAML file
(`--config job.yaml`, one mapping per section) or on the command line as `section.field=value`;
`rayppo config --yaml` prints the defaults as such a file. Cross-field checks run at load and name
the field they are about.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    out = ["| field | default | meaning |", "| --- | --- | --- |"]
    return out + [f"| `{name}` | `{_cell(default)}` | {_cell(doc)} |" for name, default, doc in rows]


def reference_markdown(cls: type = Config) -> str:
    """The page: the top-level fields, then one section (heading and table) per sub-config, in
    the order of the dataclass tree."""
    rows = field_docs(cls)
    sections: dict[str, list[tuple[str, str, str]]] = {}
    for row in rows:
        sections.setdefault(row[0].split(".")[0] if "." in row[0] else "", []).append(row)
    out = [INTRO]
    if "" in sections:
        out += ["## Top level", "", *_table(sections.pop("")), ""]
    for section, section_rows in sections.items():
        out += [f"## {section}", "", *_table(section_rows), ""]
    return "\n".join(out).rstrip() + "\n"
