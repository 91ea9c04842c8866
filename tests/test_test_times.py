"""benchmarks/test_times.py: the suite's slowest tests and time per file come from pytest's JUnit XML, and the
budget line warns past the alarm without ever failing CI (.ci/run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("bench_test_times", REPO / "benchmarks" / "test_times.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_slow" time="30.5"/>
<testcase classname="tests.test_a" name="test_quick" time="0.5"><skipped message="x"/></testcase>
<testcase classname="tests.test_b.TestGroup" name="test_mid[p1]" time="12.0"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


def test_reads_each_case_with_its_file_and_outcome(tmp_path):
    times = _module()
    (tmp_path / "j.xml").write_text(JUNIT)
    cases = times.read_junit(tmp_path / "j.xml")
    assert [(c.file, c.name, c.seconds, c.outcome) for c in cases] == [
        ("tests/test_a.py", "test_slow", 30.5, "passed"), ("tests/test_a.py", "test_quick", 0.5, "skipped"),
        ("tests/test_b.py", "test_mid[p1]", 12.0, "failed")]


def test_tables_rank_tests_and_files_by_time_and_write_them(tmp_path, capsys):
    times = _module()
    (tmp_path / "j.xml").write_text(JUNIT)
    assert times.main(["--junit", str(tmp_path / "j.xml"), "--top", "2", "--out", str(tmp_path / "out")]) == 0
    slowest = (tmp_path / "out" / "slowest.md").read_text()
    assert "Slowest 2 of 3 tests (43 s in all" in slowest
    assert slowest.index("test_a.py::test_slow") < slowest.index("test_b.py::test_mid[p1]")
    assert "test_quick" not in slowest
    per_file = (tmp_path / "out" / "per_file.md").read_text()
    assert "| 31.0 | 72.1% | 2 | tests/test_a.py |" in per_file
    assert "| 12.0 | 27.9% | 1 | tests/test_b.py |" in per_file
    assert "test_a.py::test_slow" in capsys.readouterr().out


def test_budget_line_warns_past_the_alarm_and_ci_never_fails_on_time(tmp_path, capsys):
    times = _module()
    assert "WARNING" not in times.budget_line(19 * 60, 20, 25)
    assert "WARNING: the test suite took 26.0 min, past its 25-min alarm" in times.budget_line(26 * 60, 20, 25)
    (tmp_path / "j.xml").write_text(JUNIT)
    # a slow suite prints the warning and still exits 0; a suite that wrote no XML (it crashed) is not our failure
    assert times.main(["--junit", str(tmp_path / "j.xml"), "--out", "", "--wall-s", str(40 * 60)]) == 0
    assert "WARNING" in capsys.readouterr().out
    assert times.main(["--junit", str(tmp_path / "none.xml"), "--out", "", "--wall-s", "60"]) == 0
    assert not (tmp_path / "slowest.md").exists()
