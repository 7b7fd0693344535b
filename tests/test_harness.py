"""The test harness's own hooks (tests/conftest.py)."""

from types import SimpleNamespace

from tests.conftest import pytest_runtest_logreport


def _report(nodeid: str, failed: bool) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when="call", failed=failed, longreprtext=f"E   assert 0.5 <= 0.01 in {nodeid}")


def test_failures_are_logged_as_they_happen(tmp_path, monkeypatch):
    """gpu_session.sh's failure log: each failed report appended at once (a cut session keeps the reasons), once
    (not by xdist's workers too), nothing for a pass or without the variable."""
    log = tmp_path / "failures.log"
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("MEGAKERNEL_FAILURES_LOG", raising=False)
    pytest_runtest_logreport(_report("t.py::unlogged", True))
    monkeypatch.setenv("MEGAKERNEL_FAILURES_LOG", str(log))
    pytest_runtest_logreport(_report("t.py::passes", False))
    assert not log.exists()
    pytest_runtest_logreport(_report("t.py::first[tiny-moe]", True))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytest_runtest_logreport(_report("t.py::in_a_worker", True))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    pytest_runtest_logreport(_report("t.py::second", True))
    text = log.read_text()
    assert text.count("=== ") == 2 and "=== t.py::first[tiny-moe] (call)\nE   assert 0.5 <= 0.01" in text
    assert "second" in text and "in_a_worker" not in text and "unlogged" not in text and "passes" not in text
