"""tools/hop_bench.py's hand-over protocols under the Triton interpreter: one hop, program 0 to 1 (the interpreter
runs the two programs one after the other, so a hop back would wait forever: it must end as a bounded error)."""

import pytest

from tools import hop_bench


@pytest.mark.parametrize("mode", ["counter", "ll"])
def test_each_protocol_hands_over_the_rows(mode):
    assert hop_bench.HopBench(mode, 64, "cpu").run(1)["rounds"] == 1


@pytest.mark.parametrize("mode", ["counter", "ll"])
def test_a_hop_that_never_arrives_is_an_error(monkeypatch, mode):
    monkeypatch.setattr(hop_bench, "MAX_SPINS", 50)
    with pytest.raises(RuntimeError, match="never arrived"):
        hop_bench.HopBench(mode, 64, "cpu").run(2)  # program 0 waits for hop 1, which program 1 has not run


def test_bad_sizes_and_modes_are_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        hop_bench.HopBench("mailbox", 64, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        hop_bench.HopBench("ll", 48, "cpu")
