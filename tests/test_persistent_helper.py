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
from graph.isa import BOX_ACK, BOX_SEQ, Buf, decode
from graph.lower import StepShape
from graph.verify import verify_plan
from helper_card.setup import Helper, HelperOptions
from model import init_weights, preset

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.usefixtures("one_kernel_for_tiny_models"),
              pytest.mark.skipif(not INTERPRET, reason="CPU Triton interpreter only (the GPU case needs two GPUs)")]


def _main_step(fraction=0.5, seed=5):
    """A tiny-moe megakernel with a host-paced CPU helper, after one step: its mailboxes hold the calls."""
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=3)
    helper = Helper(cfg, w, HelperOptions(kind="cpu", fraction=fraction, timeout_s=60), "cpu", torch.float32)
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16, attn_split=4, helper_slots=helper.capacity),
                        CompileOptions(workers=1))
    mk = Megakernel(plan, w, "cpu", config=LaunchConfig(max_spins=2000, helper_timeout_s=60))
    helper.attach(mk)
    mk.step(torch.randint(0, cfg.vocab_size, (2, 2), generator=torch.Generator().manual_seed(seed)),
            torch.tensor([2, 6]))
    return cfg, helper, plan, mk


def test_persistent_plan_runs_each_site_after_the_last():
    from helper_card.persistent import persistent_plan
    cfg, helper, plan, mk = _main_step()
    hplan, sites = persistent_plan(plan, helper.store.numel(), cfg.n_routed_experts, workers=3)
    verify_plan(hplan)  # counts, bounds, and no two unordered tasks touching one place
    tasks = [decode(w) for w in hplan.words]
    recv = sorted((t for t in tasks if t.op.name == "HELPER_RECV"), key=lambda t: t.signal)
    send = sorted((t for t in tasks if t.op.name == "HELPER_SEND"), key=lambda t: t.signal)
    assert len(recv) == len(send) == len(sites) >= 2
    assert recv[0].waits == () and all(r.waits == ((s.signal, 1),) for r, s in zip(recv[1:], send))
    assert [r["nlater"] for r in recv] == list(range(len(sites) - 1, -1, -1))
    helper.close()


def test_persistent_helper_answers_each_call_like_the_helper_gpu():
    from helper_card.backends import on_device
    from helper_card.kernel_helper import KernelHelper, helper_table
    from helper_card.mailbox import call_sites
    from helper_card.persistent import PersistentHelper
    cfg, helper, plan, mk = _main_step()
    E, epoch = cfg.n_routed_experts, mk.epoch
    store = on_device(helper.store, "cpu")
    box = mk.mem.bufs[Buf.H].numpy()
    sites = call_sites(plan)
    called = [s for s in sites if box[s.box + BOX_SEQ] == epoch]
    assert 0 < len(called) < len(sites)  # some layers called the helper, some skipped it
    for s in sites:  # forget the host-paced helper's answers: what is left is the persistent kernel's
        parts = s.parts
        box[s.box + BOX_ACK] = 0
        box[parts["mask"]: parts["table"]] = 0
    persistent = PersistentHelper(mk, store, helper.layers, E, workers=1)
    persistent.place(helper.placement)
    persistent.finish(epoch)  # the step is over: the sites it skipped end their wait at once
    persistent.launch(epoch)
    persistent.mk.check_error()
    reference = KernelHelper(mk, store, helper.layers, E, workers=1)
    for s in sites:
        P, K, at = s.P, s.K, s.parts
        if s not in called:
            assert box[s.box + BOX_ACK] == 0 and not box[at["mask"]: at["table"]].any()
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
    helper.close()


def test_persistent_helper_without_a_main_step_stops_on_its_bound():
    """Launched for a step the main runner never runs, the first site's wait ends on its bound with the
    watchdog's error naming it (not a hang); CTL_DONE then lets the next launch through."""
    from helper_card.backends import on_device
    from helper_card.persistent import PersistentHelper
    from megakernel.runtime import WatchdogError
    cfg, helper, plan, mk = _main_step()
    persistent = PersistentHelper(mk, on_device(helper.store, "cpu"), helper.layers, cfg.n_routed_experts, workers=1)
    persistent.place(helper.placement)
    persistent.launch(mk.epoch + 1)
    with pytest.raises(WatchdogError, match=r"helper\.recv.*persistent helper saw neither call"):
        persistent.mk.check_error()
    persistent.finish(mk.epoch + 1)  # as the step boundary would: every site passed
    persistent.launch(mk.epoch + 1)
    persistent.mk.check_error()
    helper.close()
