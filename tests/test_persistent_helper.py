"""A persistent helper kernel (helper_card/persistent.py) answers a main step's helper calls from the
mailboxes alone: per site, the rows the host-paced helper GPU computes (kernel_helper, bit for bit), their
mask and the acknowledgement; nothing for a site the step skipped.

On a CPU the kernel runs under TRITON_INTERPRET (one worker, after the main step: the interpreter runs
one program at a time, so the main step's calls are in the mailboxes before the helper kernel starts)."""

import os

import numpy as np
import pytest
import torch

from graph.compile import CompileOptions, compile_step
from graph.isa import BOX_ACK, BOX_PASSED, BOX_SEQ, Buf, decode
from graph.lower import StepShape
from graph.verify import verify_plan
from helper_card.setup import Helper, HelperOptions
from model import init_weights, preset

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.usefixtures("one_kernel_for_tiny_models"),
              pytest.mark.skipif(not INTERPRET, reason="CPU Triton interpreter only (the GPU case needs two GPUs)")]


def _main_step(steps=1, seed=5):
    """A tiny-moe megakernel with a host-paced CPU helper and, built before its first step, a persistent
    helper kernel (not launched by it), after `steps` steps: its mailboxes hold the last step's calls."""
    from helper_card.backends import on_device
    from helper_card.persistent import PersistentHelper
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=3)
    helper = Helper(cfg, w, HelperOptions(kind="cpu", fraction=0.5, timeout_s=60), "cpu", torch.float32)
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16, attn_split=4, helper_slots=helper.capacity),
                        CompileOptions(workers=1))
    mk = Megakernel(plan, w, "cpu", config=LaunchConfig(max_spins=2000, helper_timeout_s=60))
    helper.attach(mk)
    store = on_device(helper.store, "cpu")
    persistent = PersistentHelper(mk, store, helper.layers, cfg.n_routed_experts, workers=1)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        mk.step(torch.randint(0, cfg.vocab_size, (2, 2), generator=gen), torch.tensor([2 + step, 6 + step]))
    return cfg, helper, plan, mk, persistent, store


def _forget_answers(box, sites):
    """Wipe the host-paced helper's acknowledgements, masks and rows: what is left is the kernel's."""
    for s in sites:
        box[s.box + BOX_ACK] = 0
        box[s.parts["mask"]: s.parts["table"]] = 0


def _check_answers(box, sites, epoch, helper, reference):
    """Each call of step `epoch` answered as the helper GPU's site kernels answer it (bit for bit); no
    answer for a site the step skipped."""
    from helper_card.kernel_helper import helper_table
    for s in sites:
        P, K, at = s.P, s.K, s.parts
        if box[s.box + BOX_SEQ] != epoch:
            assert box[s.box + BOX_ACK] == 0 and not box[at["mask"]: at["table"]].any(), s.layer
            continue
        assert box[s.box + BOX_ACK] == epoch
        table = box[at["table"]: at["table"] + 2 * s.S + s.S * P].copy()
        chosen = [j for j in range(s.S) if table[j] >= 0 and helper.placement.on_helper(s.layer, int(table[j]))]
        want_mask = np.zeros(P, dtype=np.int32)
        for j in chosen:
            want_mask[table[2 * s.S + j * P: 2 * s.S + j * P + table[s.S + j]]] = 1
        assert want_mask.any() and (box[at["mask"]: at["mask"] + P] == want_mask).all(), s.layer
        x = torch.from_numpy(box[at["x"]: at["x"] + s.N * K].view(np.float32).reshape(s.N, K).copy())
        want = reference.run(s.signal, helper_table(table, s.S, chosen), x)
        got = torch.from_numpy(box[at["ans"]: at["ans"] + P * K].view(np.float32).reshape(P, K).copy())
        rows = torch.from_numpy(want_mask.astype(bool))
        assert torch.equal(got[rows], want[rows]), s.layer  # the same tiles: bit for bit


def test_persistent_plan_runs_each_site_after_the_last():
    cfg, helper, plan, mk, persistent, _ = _main_step(steps=0)
    hplan = persistent.plan
    verify_plan(hplan)  # counts, bounds, and no two unordered tasks touching one place
    tasks = [decode(w) for w in hplan.words]
    recv = sorted((t for t in tasks if t.op.name == "HELPER_RECV"), key=lambda t: t.signal)
    send = sorted((t for t in tasks if t.op.name == "HELPER_SEND"), key=lambda t: t.signal)
    assert len(recv) == len(send) == len(persistent.sites) >= 2
    assert recv[0].waits == () and all(r.waits == ((s.signal, 1),) for r, s in zip(recv[1:], send))
    assert len({r["done.off"] for r in recv}) == 1 and len({r["box.off"] for r in recv}) == len(recv)
    assert {r["epoch0"] for r in recv} == {0}  # built before the runner's first step
    helper.close()


@pytest.mark.parametrize("released", [False, True], ids=["passed_words", "released"])
def test_persistent_helper_answers_each_call_like_the_helper_gpu(released):
    """Every call answered bit for bit as kernel_helper's graphs answer it.  A skipped site learns it was
    passed from its mailbox's BOX_PASSED word (HELPER_CALL writes it instead of a request), or from
    CTL_DONE when the host released the step."""
    from helper_card.kernel_helper import KernelHelper
    from helper_card.mailbox import call_sites
    cfg, helper, plan, mk, persistent, store = _main_step()
    box = mk.mem.bufs[Buf.H].numpy()
    sites = call_sites(plan)
    called = [i for i, s in enumerate(sites) if box[s.box + BOX_SEQ] == mk.epoch]
    assert 0 < len(called) < len(sites)  # some layers called the helper, some skipped it
    passed = [i for i, s in enumerate(sites) if box[s.box + BOX_PASSED] == mk.epoch]
    assert sorted(called + passed) == list(range(len(sites)))  # each site either called or said it passed
    _forget_answers(box, sites)
    persistent.place(helper.placement)
    if released:
        persistent.release(mk.epoch)
    persistent.launch(mk.epoch)
    persistent.mk.check_error()
    _check_answers(box, sites, mk.epoch, helper, KernelHelper(mk, store, helper.layers, cfg.n_routed_experts, 1))
    if not released:  # the plan again through its reference semantics (ops.REFERENCE), as the interpreter would
        kernel_answers = box.copy()
        _forget_answers(box, sites)
        _run_references(persistent, launch=1)
        for s in sites:
            head, at = slice(s.box + BOX_ACK, s.box + BOX_ACK + 1), slice(s.parts["mask"], s.parts["ans"])
            assert (box[head] == kernel_answers[head]).all() and (box[at] == kernel_answers[at]).all(), s.layer
            ans = slice(s.parts["ans"], s.parts["table"])
            assert np.allclose(box[ans].view(np.float32), kernel_answers[ans].view(np.float32), rtol=1e-5,
                               atol=1e-6), s.layer
    helper.close()


def _run_references(persistent, launch):
    """The helper plan's tasks in queue order (one worker) through ops.REFERENCE, as the kernel's
    `launch`-th launch: HELPER_RECV/SEND's reference semantics beside the bodies the kernel ran."""
    from megakernel.ops import REFERENCE
    assert persistent.plan.workers == 1
    mem = persistent.mk.mem
    mem.epoch = launch  # the launch count reference_recv adds epoch0 to
    for word in persistent.plan.words:
        task = decode(word)
        REFERENCE[task.op.name](task, mem)


def test_persistent_helper_answers_only_its_own_step():
    """A launch answers the step its launch count names, even when the mailboxes already hold a later
    step's calls and passes (a kernel that starts late); one launch per main step, which `launch` checks."""
    from helper_card.kernel_helper import KernelHelper
    from helper_card.mailbox import call_sites
    cfg, helper, plan, mk, persistent, store = _main_step(steps=2)
    box = mk.mem.bufs[Buf.H].numpy()
    sites = call_sites(plan)
    assert any(box[s.box + BOX_SEQ] == 2 for s in sites)
    _forget_answers(box, sites)
    persistent.place(helper.placement)
    persistent.launch(1)  # step 1's kernel, late: every site already holds step 2's call or pass
    persistent.mk.check_error()
    assert not any(box[s.box + BOX_ACK] == 2 for s in sites)  # none of step 2's calls taken by step 1's kernel
    with pytest.raises(RuntimeError, match="launches step 3, but the helper's next launch answers step 2"):
        persistent.launch(3)
    _forget_answers(box, sites)
    persistent.launch(2)
    persistent.mk.check_error()
    _check_answers(box, sites, 2, helper, KernelHelper(mk, store, helper.layers, cfg.n_routed_experts, 1))
    helper.close()


def test_persistent_helper_waits_out_a_step_that_never_comes():
    """Launched for a step that never reaches the sites (it failed before them, and the host has not yet
    released it), the first site waits out its bound and passes, and the kernel's later sites pass at
    once: no answer, no error."""
    from helper_card.mailbox import call_sites
    cfg, helper, plan, mk, persistent, _ = _main_step()
    box = mk.mem.bufs[Buf.H].numpy()
    sites = call_sites(plan)
    _forget_answers(box, sites)
    persistent.place(helper.placement)
    persistent.launch(1)  # answers step 1 (already run: it acknowledges step 1's calls) ...
    assert not persistent.failures()
    persistent.launch(2)  # ... and step 2, which never comes
    persistent.mk.check_error()
    gaveup = persistent.plan.task(0)["gaveup.off"]
    assert int(persistent.mk.mem.bufs[Buf.I][gaveup]) == 2  # the first site's bound passed step 2's sites
    mk.epoch = 2  # as if the main step had run and failed: the watchdog's diagnostics name the give-up
    assert any("waited out its bound" in f and "step 2" in f for f in persistent.failures())
    helper.close()
