"""``promtool test rules`` on a PrometheusRule of k8s/: its groups, written as a rule file, against
unit-test cases (input series, expected samples or alerts)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml


def test_rules(tmp: Path, rule: Path, tests: list[dict], interval: str = "15s") -> subprocess.CompletedProcess:
    """Runs ``tests`` (promtool's test cases) against the PrometheusRule in ``rule``."""
    assert shutil.which("promtool"), "promtool is missing: run scripts/setup.sh (Debian package prometheus)"
    groups = yaml.safe_load(rule.read_text())["spec"]["groups"]
    (tmp / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    cases = {"rule_files": ["rules.yaml"], "evaluation_interval": interval, "tests": tests}
    (tmp / "test.yaml").write_text(yaml.safe_dump(cases))
    return subprocess.run(
        ["promtool", "test", "rules", "test.yaml"], cwd=tmp, capture_output=True, text=True, timeout=60
    )


test_rules.__test__ = False  # a helper, not a pytest test
