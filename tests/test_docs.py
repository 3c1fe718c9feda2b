"""docs/design.md cannot drift from the code: its op schemas are the registered ones, and its
module map lists the package's files with their line counts (docs/symm_mem.md's schemas too)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import alltoall_ops  # noqa: F401  (registers every op)

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "alltoall_ops"
LINE_TOLERANCE = 0.15
"""A listed line count may differ from the file's by 15% (or by MIN_LINE_SLACK lines)."""
MIN_LINE_SLACK = 10


def _section_block(text: str, heading: str) -> str:
    """The first fenced block after ``## heading``."""
    section = text.split(f"\n## {heading}\n", 1)[1]
    return section.split("```", 2)[1]


def _normalise(schema: str) -> str:
    """One space between tokens, none inside brackets or before commas."""
    schema = re.sub(r"\s+", " ", schema.strip())
    return re.sub(r"\s*([(),\[\]])\s*", r"\1", schema).replace(",", ", ")


def _documented_schemas(text: str) -> dict[str, str]:
    """name -> schema of every ``alltoall_ops::name(...)`` entry of a block (entries may wrap)."""
    entries = re.split(r"^(?=alltoall_ops::)", text, flags=re.M)
    schemas = {}
    for entry in entries:
        if entry.startswith("alltoall_ops::"):
            name = entry[len("alltoall_ops::"):].split("(", 1)[0]
            assert name not in schemas, f"{name} is documented twice"
            schemas[name] = _normalise(entry)
    return schemas


def _registered_schemas() -> dict[str, str]:
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("alltoall_ops::")}
    return {name: _normalise(str(getattr(torch.ops.alltoall_ops, name).default._schema)) for name in names}


def test_design_lists_every_registered_op_with_its_schema():
    documented = _documented_schemas(_section_block(DESIGN.read_text(), "Ops and schemas"))
    registered = _registered_schemas()
    assert sorted(documented) == sorted(registered), "docs/design.md 'Ops and schemas' and the registered ops"
    wrong = {name: (documented[name], registered[name]) for name in registered if documented[name] != registered[name]}
    assert not wrong, f"documented vs registered schemas: {wrong}"


@pytest.mark.parametrize("doc", ["design.md", "symm_mem.md"])
def test_every_schema_written_in_the_docs_is_registered(doc):
    text = (ROOT / "docs" / doc).read_text()
    blocks = text.split("```")[1::2]
    documented = {}
    for block in blocks:
        documented.update(_documented_schemas(block))
    registered = _registered_schemas()
    wrong = {name: (schema, registered.get(name)) for name, schema in documented.items()
             if schema != registered.get(name)}
    assert documented and not wrong, f"{doc}: documented vs registered schemas: {wrong}"


def _module_map() -> dict[str, int]:
    """path relative to the repo -> listed line count, from design.md's module map: an entry is
    a line indented by less than 20 columns whose first word is a .py file or a folder/."""
    listed, stack = {}, []  # stack: (indent, folder path) of the enclosing folders
    for line in _section_block(DESIGN.read_text(), "Module map").splitlines():
        match = re.match(r"^( *)(\S+(?:\.py|/))(?:\s+(\d+))?", line)
        if not match or len(match.group(1)) >= 20:
            continue  # a description's continuation
        indent, name, count = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(folder for _, folder in stack) + name
        if name.endswith("/"):
            stack.append((indent, name))
        else:
            assert count is not None, f"module map: {path} has no line count"
            listed[path] = int(count)
    return listed


def test_module_map_matches_the_tree():
    listed = _module_map()
    files = {str(p.relative_to(ROOT)): p for p in PACKAGE.rglob("*.py")}
    assert sorted(listed) == sorted(files), "docs/design.md's module map and alltoall_ops/**/*.py"
    counts = {path: len(p.read_text().splitlines()) for path, p in files.items()}
    stale = {path: (listed[path], counts[path]) for path in files
             if abs(listed[path] - counts[path]) > max(LINE_TOLERANCE * counts[path], MIN_LINE_SLACK)}
    assert not stale, f"module map line counts (listed, wc -l) off by more than 15%: {stale}"
