"""The chart without helm: CRD copy, versions, values documented and valid against the schema."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "shardline"


def test_chart_crd_is_identical_to_top_level_crd():
    top = REPO_ROOT / "crds" / "inferencedeployment.yaml"
    copy = CHART / "crds" / "inferencedeployment.yaml"
    assert copy.read_bytes() == top.read_bytes(), "run: cp crds/inferencedeployment.yaml charts/shardline/crds/"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["inferencedeployment.yaml"]


def test_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]


def test_values_validate_against_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    bad = dict(values, logLevel="verbose")
    try:
        jsonschema.validate(bad, schema)
    except jsonschema.ValidationError as exc:
        assert "verbose" in str(exc)
    else:
        raise AssertionError("logLevel=verbose must be rejected by values.schema.json")


def test_every_value_is_documented():
    """Each key has a ``# --`` comment on itself or on an enclosing key."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):(.*)$", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = (i > 0 and lines[i - 1].strip().startswith("# --")) or any(d for _, d in stack)
        is_parent = match.group(3).strip() == ""
        if not documented and not is_parent:
            undocumented.append(match.group(2))
        stack.append((indent, documented))
    assert undocumented == [], f"values without a '# --' comment: {undocumented}"
