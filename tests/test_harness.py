"""The test harness's own hooks (tests/conftest.py)."""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import pytest_runtest_logreport


def _report(nodeid: str, failed: bool) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when="call", failed=failed,
                           longreprtext=f"E   assert 0.5 <= 0.01 in {nodeid}")


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


INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _times_two(src, dst):
    tl.store(dst, tl.load(src) * 2)


def _doubled(big: int) -> int:
    src, dst = torch.tensor([big], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _times_two[(1,)](src, dst)
    return int(dst[0])


@pytest.mark.skipif(not INTERPRETING, reason="the interpreter's options")
def test_the_interpreters_overflow_check_never_fired(monkeypatch):
    """Why conftest turns sanitize_overflow off: with it on (Triton's default), an int32 overflow still wraps
    silently, as compiled code does, because the interpreter's debug is off and its device_assert a no-op.  If a
    Triton makes it fire, this fails: then keep it on."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    assert not builder.options.debug
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    assert _doubled(3) == 6 and _doubled(2**30 + 1) == -(2**31) + 2


@pytest.mark.skipif(not INTERPRETING, reason="the interpreter's options")
def test_the_suite_runs_without_the_unused_overflow_arithmetic():
    from triton.runtime import interpreter
    plain = os.environ.get("MEGAKERNEL_TEST_PLAIN_INTERPRETER") == "1"
    assert interpreter.interpreter_builder.options.sanitize_overflow == plain
    assert _doubled(2**30 + 1) == -(2**31) + 2  # wraps, as compiled int32 arithmetic does
