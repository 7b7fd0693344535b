"""Experts on a helper, with the megakernel as the main side: its step is one launch (one graph
replay on a GPU), so a layer's call reaches the helper through a mailbox in host memory that a host
thread serves (helper_card/mailbox.py).  The megakernel with a helper equals the plan interpreter
with one (the same plan), counts the same calls, skips and rows, and a silent helper is a bounded
error after which the next step runs.

On a CPU the kernel runs under TRITON_INTERPRET (one worker); on a GPU (`gpu`) the compiled kernel
reads and writes the mailboxes in pinned host memory over the bus."""

import os
import sys
import time

import pytest
import torch

from graph.compile import CompileOptions, compile_step
from graph.isa import BOX_ACK, BOX_HEADER, BOX_T_ANSWER, Buf
from graph.lower import StepShape
from helper_card.setup import Helper, HelperOptions
from megakernel.interpreter import Interpreter
from model import init_weights, preset

from .conftest import rel_err

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.usefixtures("one_kernel_for_tiny_models")
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton interpreter only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _runners(name, device, opts, workers, T=2, B=2, passes=1, config=None):
    """(helper, interpreter, helper, megakernel) of one helper plan, each runner with its own helper."""
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset(name)
    w = init_weights(cfg, seed=3)
    helpers = [Helper(cfg, w, opts, device, torch.float32) for _ in range(2)]
    shape = StepShape(T=T, B=B, max_len=16, mtp_passes=passes if cfg.num_nextn_predict_layers else 0, attn_split=4,
                      helper_slots=helpers[0].capacity)
    plan = compile_step(cfg, shape, CompileOptions(workers=workers))
    interp = Interpreter(plan, w, device)
    mk = Megakernel(plan, w, device, config=config or LaunchConfig(max_spins=100_000,
                                                                   helper_timeout_s=opts.timeout_s))
    helpers[0].attach(interp)
    helpers[1].attach(mk)
    return cfg, helpers, interp, mk


def _check_timeline(helper, calls, helper_gpu, hosted=True):
    """The step's calls each left a timeline (HelperMetrics.timeline): the host's stamps in order where a
    host thread served them, and on a GPU the main GPU's (one clock: published before acked, at least
    the exposed wait apart)."""
    timeline, helper.link.metrics.timeline = helper.link.metrics.timeline, []
    assert len(timeline) == calls
    for c in timeline:
        assert (0 < c.noticed <= c.handed) if hosted else c.noticed == c.handed == 0, c
        if not INTERPRET:
            assert 0 < c.published and c.acked - c.published >= c.wait_ns > 0, c
        assert (c.answered > 0) == (helper_gpu and not INTERPRET), c


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fraction,blocks", [(0.5, None), (1.0, None), (0.5, dict(EPF=1))],
                         ids=["half", "all", "half-EPF"])
def test_megakernel_with_a_helper_equals_the_interpreter_with_one(device, fraction, blocks):
    """EPF=1 (launch variant): the main side's expert tasks read an expert map, so they guess no expert before
    their wait and take the path a stale guess takes."""
    from megakernel.runtime import LaunchConfig
    workers = 1 if device == "cpu" else 16
    opts = HelperOptions(kind="cpu", fraction=fraction, migrate=True, window=2, timeout_s=60 if INTERPRET else 2.0)
    default_switch = sys.getswitchinterval()
    config = LaunchConfig(max_spins=100_000, helper_timeout_s=opts.timeout_s, blocks=blocks)
    cfg, (h_interp, h_mk), interp, mk = _runners("tiny-moe", device, opts, workers, config=config)
    if device == "cuda":
        mk.capture()
    gen = torch.Generator().manual_seed(1)
    h_mk.link.metrics.timeline = []
    for step in range(2 if INTERPRET else 4):
        tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=gen)
        lens = torch.tensor([step, 5 + step])
        want, got = interp.step(tokens, lens), mk.step(tokens, lens)
        assert rel_err(got.logits, want.logits) <= 1e-5
        assert torch.equal(got.tokens, want.tokens)
        a, b = h_interp.end_step(), h_mk.end_step()
        for key in ("calls", "skipped", "rows"):  # the mailboxes count what the interpreter's link counts
            assert a[key] == b[key], (step, key, a, b)
        _check_timeline(h_mk, b["calls"], helper_gpu=False)
        if fraction == 1.0:
            assert b["skipped"] == 0 and b["rows"] == 2 * 2 * cfg.num_experts_per_tok * b["calls"]
        if not INTERPRET and b["calls"]:
            assert b["exposed_wait_ms"] > 0  # measured on the device timer
    # routing statistics from the mailboxes' slot tables: the same counts the interpreter's calls saw
    for layer, counts in h_interp.link.stats.counts().items():
        assert (h_mk.link.stats.counts()[layer] == counts).all()
    # while the mailbox thread serves, a waiting thread gets the GIL within SWITCH_S; restored after
    from helper_card.mailbox import SWITCH_S
    assert sys.getswitchinterval() <= SWITCH_S * 1.01 < default_switch
    for h in (h_interp, h_mk):
        h.close()
    assert sys.getswitchinterval() == default_switch


@pytest.mark.parametrize("device", DEVICES)
def test_megakernel_with_a_silent_helper_is_a_bounded_error_and_the_next_step_runs(device):
    from megakernel.runtime import LaunchConfig, WatchdogError
    # under the interpreter the kernel's bound is a number of polls (no timer; ~0.4 ms each) and the
    # helper thread shares the GIL with the interpreted kernel, so every bound is longer there
    bound, stall = (1.5, 3.0) if device == "cpu" else (0.3, 1.0)
    opts = HelperOptions(kind="cpu", fraction=1.0, timeout_s=bound)
    config = LaunchConfig(max_spins=8000, helper_timeout_s=bound)
    cfg, (h_interp, h_mk), interp, mk = _runners("tiny-moe", device, opts, 1 if device == "cpu" else 16, T=1, B=1,
                                                passes=0, config=config)
    tok, lens = torch.tensor([[7]]), torch.tensor([3])
    mk.step(tok, lens)  # compiled and answered once before the stall
    h_mk.backend.stall_s = stall
    t0 = time.perf_counter()
    with pytest.raises(WatchdogError, match="the helper did not answer call 2"):
        mk.step(tok, lens)
    if device == "cuda":
        assert time.perf_counter() - t0 < bound + 0.5  # the bound, not the stall, ends the wait
    h_mk.backend.stall_s = 0.0
    time.sleep(max(0.0, stall - (time.perf_counter() - t0)) + 0.2)  # the stalled call drains from the queue
    want, got = interp.step(tok, lens), mk.step(tok, lens)
    assert rel_err(got.logits, want.logits) <= 1e-5
    for h in (h_interp, h_mk):
        h.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for the helper")
@pytest.mark.parametrize("persistent", [False, True], ids=["host_paced", "persistent"])
def test_megakernel_with_a_second_gpu_as_helper_is_bit_exact_with_all_on_main(persistent):
    """cuda:1 runs each call's expert tiles with the megakernel (kernel_helper's graph per call, or one
    persistent kernel per step: helper_card/persistent.py), so the output is the all-on-main
    megakernel's bit for bit; calls and skips are the interpreter's."""
    from megakernel.runtime import Megakernel
    opts = HelperOptions(kind="cuda:1", fraction=0.5, timeout_s=5.0, persistent=persistent)
    cfg, (h_interp, h_mk), interp, mk = _runners("tiny-moe", "cuda", opts, 16)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=1 if cfg.num_nextn_predict_layers else 0, attn_split=4)
    plain = Megakernel(compile_step(cfg, shape, CompileOptions(workers=16)), init_weights(cfg, seed=3), "cuda")
    service = h_mk.services[0]  # the helper GPU path, not the host's matmuls
    assert (service.persistent if persistent else service.kernel) is not None
    mk.capture()
    plain.capture()
    gen = torch.Generator().manual_seed(2)
    h_mk.link.metrics.timeline = []
    for step in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=gen)
        lens = torch.tensor([step, 3 + step])
        want, got, alone = interp.step(tokens, lens), mk.step(tokens, lens), plain.step(tokens, lens)
        assert torch.equal(got.logits, alone.logits), step
        assert rel_err(got.logits, want.logits) <= 1e-5
        a, b = h_interp.end_step(), h_mk.end_step()
        assert (a["calls"], a["skipped"], a["rows"]) == (b["calls"], b["skipped"], b["rows"])
        assert b["calls"] > 0
        _check_timeline(h_mk, b["calls"], helper_gpu=True, hosted=not persistent)
    for h in (h_interp, h_mk):
        h.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_helper_call_is_named_in_the_watchdog_error(device):
    from megakernel.runtime import LaunchConfig, WatchdogError
    opts = HelperOptions(kind="cpu", fraction=1.0, timeout_s=1.5 if device == "cpu" else 0.3)
    config = LaunchConfig(max_spins=8000, helper_timeout_s=opts.timeout_s)
    cfg, helpers, interp, mk = _runners("tiny-moe", device, opts, 1 if device == "cpu" else 16, T=1, B=1, passes=0,
                                        config=config)
    service = helpers[1].services[0]

    def broken(*call):
        raise ValueError("no such expert")
    service.program.run = broken
    with pytest.raises(WatchdogError, match="helper service: layer .* call 1: RuntimeError.*no such expert"):
        mk.step(torch.tensor([[7]]), torch.tensor([3]))
    for h in helpers:
        h.close()


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_helper_rows_are_the_main_megakernels_rows_bit_for_bit(device):
    """A helper GPU runs each call site's expert tiles with the megakernel (helper_card.kernel_helper):
    fed the routed table and token rows of a step in which main computed every expert, its rows are
    main's, bit for bit (same bodies, same stream block sizes).  On a GPU the site kernels run on the
    main GPU here, one call at a time (two GPUs: the two-GPU test below, through the mailbox)."""
    from graph.isa import decode
    from helper_card.backends import on_device
    from helper_card.kernel_helper import KernelHelper
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=3)
    workers = 1 if device == "cpu" else 16  # interpreted programs run one after another: one worker
    helper = Helper(cfg, w, HelperOptions(kind="cpu", fraction=0.0), device, torch.float32)
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16, attn_split=4, helper_slots=helper.capacity),
                        CompileOptions(workers=workers, reuse_memory=False))  # every layer's rows stay readable
    mk = Megakernel(plan, w, device, config=LaunchConfig(max_spins=100_000))
    helper.attach(mk)
    mk.step(torch.randint(0, cfg.vocab_size, (2, 2), generator=torch.Generator().manual_seed(5)), torch.tensor([2, 6]))
    kernel = KernelHelper(mk, on_device(helper.store, device), helper.layers, cfg.n_routed_experts, workers=workers)
    A, I = mk.mem.bufs[Buf.A], mk.mem.bufs[Buf.I]
    calls = {t.signal: t for t in map(decode, plan.words) if t.op.name == "HELPER_CALL"}
    assert len(kernel.sites) == len(calls) >= 2
    for signal, site in kernel.sites.items():
        call, prog = calls[signal], site.prog
        table = I[call["st.off"]: call["st.off"] + 2 * prog.S + prog.S * prog.P].cpu().numpy()
        x = A.as_strided((call["N"], call["K"]), (call["x.ld"], 1), call["x.off"])
        got = kernel.run(signal, table, x)
        want = A.as_strided((prog.P, call["K"]), (prog.y[1], 1), prog.y[0])
        assert torch.equal(got, want), prog.layer
    helper.close()


@pytest.mark.parametrize("device", DEVICES)
def test_helper_gpu_copies_move_the_marked_rows_and_then_acknowledge(device):
    """The kernels around a helper GPU's site megakernel (ops.helper): copy_rows honours both strides and
    keeps the sequence number it acquired; publish_rows copies only the rows the host marked (the
    others are main's), then acknowledges that call; after a failed site kernel it does nothing."""
    from megakernel.ops.helper import copy_rows, publish_rows
    compiled = device == "cuda"  # the inline-PTX acquire, fence and release (the interpreter: atomics)
    src = torch.randn(3, 40, device=device)
    dst = torch.zeros(3, 24, device=device)
    gate = torch.tensor([5], dtype=torch.int32, device=device)
    seq = torch.zeros(1, dtype=torch.int32, device=device)
    copy_rows[(3,)](src, 40, dst, 24, 20, gate, seq, compiled, True, BLOCK=8)
    assert torch.equal(dst[:, :20], src[:, :20]) and not dst[:, 20:].any()
    assert int(seq) == 5  # the sequence number the copy acquired, kept for the acknowledgement
    gate.fill_(6)  # the host staged the next call meanwhile: the acknowledgement still names call 5
    box = torch.zeros(3 * 20, device=device)
    mask = torch.tensor([1, 0, 1], dtype=torch.int32, device=device)
    header, err = (torch.zeros(BOX_HEADER, dtype=torch.int32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))
    ack = header[BOX_ACK:]  # the acknowledgement's word of a mailbox header, which also gets the answer's stamp
    publish_rows[(1,)](src, 40, box, mask, 3, 20, ack, gate, seq, err, compiled, BLOCK=8)
    rows = box.view(3, 20)
    assert torch.equal(rows[0], src[0, :20]) and torch.equal(rows[2], src[2, :20]) and not rows[1].any()
    assert int(header[BOX_ACK]) == 5
    answered = int(header[BOX_T_ANSWER: BOX_T_ANSWER + 2].view(torch.int64))
    assert (answered > 0) == compiled  # the helper GPU's timer when its rows went out (none interpreted)
    assert not header[BOX_ACK + 1: BOX_T_ANSWER].any() and not header[BOX_T_ANSWER + 2:].any()
    # a site kernel stopped by its watchdog: no rows, no acknowledgement (main's bound reports the helper)
    box.zero_(), header.zero_(), err.fill_(1)
    publish_rows[(1,)](src, 40, box, mask, 3, 20, ack, gate, seq, err, compiled, BLOCK=8)
    assert not box.any() and not header.any()
