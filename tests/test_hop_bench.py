"""tools/hop_bench.py's hand-over protocols under the Triton interpreter.  It runs a launch's programs one after the
other, so only a one-program chain can run there (the program reads back its own rows through the protocol); with
two, program 0 waits for rows program 1 has not written, which must end as the bound's error, not a hang."""

import pytest

from tools import hop_bench


@pytest.mark.parametrize("mode", ["counter", "ll", "early"])
def test_each_protocol_hands_over_the_rows(mode):
    bench = hop_bench.HopBench(mode, 64, 1, "cpu")
    assert bench.run(3)["rounds"] == 3
    assert bench.run(2)["rounds"] == 2  # a second launch: counters and flags go on from the first's


@pytest.mark.parametrize("mode", ["counter", "ll"])
def test_a_hop_that_never_arrives_is_an_error(monkeypatch, mode):
    monkeypatch.setattr(hop_bench, "MAX_SPINS", 50)
    with pytest.raises(RuntimeError, match="hop 0 never arrived"):
        hop_bench.HopBench(mode, 64, 2, "cpu").run(2)


def test_bad_sizes_modes_and_programs_are_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        hop_bench.HopBench("mailbox", 64, 1, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        hop_bench.HopBench("ll", 48, 1, "cpu")
    with pytest.raises(ValueError, match="programs=65"):
        hop_bench.HopBench("ll", 64, 65, "cpu")
    with pytest.raises(ValueError, match="mode 'word' uses inline PTX: GPU only"):
        hop_bench.HopBench("word", 64, 1, "cpu")
    with pytest.raises(ValueError, match="mode 'nc' uses inline PTX: GPU only"):
        hop_bench.HopBench("nc", 64, 1, "cpu")
