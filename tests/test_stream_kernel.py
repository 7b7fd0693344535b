"""The stream kernel (megakernel/stream_kernel.py): a plan's LINEAR tasks in a Gluon kernel beside the Triton one.
On a CPU: it compiles for sm_90 (Gluon has no interpreter) and the runtime refuses what it cannot run; on a GPU
(`pytest -m gpu`): logits equal the interpreter's, and the watchdog fires on a stalled stream task and recovers."""

import os
import subprocess
import sys

import pytest
import torch

from graph.compile import CompileOptions, compile_step
from graph.lower import StepShape
from model import init_weights, preset

from .conftest import rel_err, stall_is_a_watchdog_error_then_recovers

BF16_TOL = 1e-2

COMPILE_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from megakernel import stream_kernel as sk
from megakernel.ops.linear_ring import TILE_COLS
layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
for profile, box in ((False, 16), (True, 8)):
    const = dict(WORDS=64, MAX_WAITS=4, TIMEOUT_NS=250_000_000, MAX_SPINS=1000, USE_TIMER=True, PROFILE=profile,
                 ALIGN=4, SLOTS=sk.SLOTS, SUB=sk.SUB * 16 // box, WARPS=sk.CONSUMER_WARPS, BOX=box)
    tile = torch.zeros(box, TILE_COLS, dtype=torch.bfloat16)
    desc = native_specialize_impl(BaseBackend, TensorDescriptor.from_tensor(tile, [box, TILE_COLS], layout),
                                  False, True, True)[0]
    sig = {**{f"d{i}": desc for i in range(4)}, "K1": "i32", "K2": "i32", "K3": "i32",
           **{n: "*i32" for n in ("words", "queue_ptr", "counters", "worker_epoch", "err")}, "prof": "*i64",
           "A": "*fp32", "WORKER0": "i32", **{n: "constexpr" for n in const}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7, 14)}
    k = triton.compile(GluonASTSource(fn=sk.stream_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": sk.CONSUMER_WARPS, "maxnreg": sk.MAXNREG})
    ptx = k.asm["ptx"]
    # weights by TMA into the ring, mbarrier hand-offs, the plan's acquire waits and release signals, the bound
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert "atom.global.gpu.release" in ptx and "ld.global.gpu.acquire" in ptx and "%globaltimer" in ptx
    if profile:  # the task's stamps: 64-bit timer words
        assert "st.global.b64" in ptx or "st.global.u64" in ptx
    print("shared", k.metadata.shared, "warps", k.metadata.num_warps)
"""


def test_stream_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("shared")]
    assert len(shared) == 2 and all(s < 140 * 1024 for s in shared), out.stdout  # leaves the Triton CTA ~88 KB


def _stream_plan(name, layers=None, workers=16, T=1, B=1, max_len=64):
    cfg = preset(name)
    if layers is not None:
        cfg = cfg.replace(num_hidden_layers=layers)
    return cfg, compile_step(cfg, StepShape(T=T, B=B, max_len=max_len),
                             CompileOptions(workers=workers, stream_kernel=True))


def test_stream_plan_needs_a_gpu():
    """Without CUDA (the interpreter's CPU runs) a stream plan is refused by name, not run half-way."""
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    from megakernel.runtime import Megakernel, MegakernelError
    cfg, plan = _stream_plan("tiny-dense")
    with pytest.raises(MegakernelError, match="stream workers"):
        Megakernel(plan, init_weights(cfg, dtype=torch.bfloat16), "cpu", torch.bfloat16)


def test_stream_tasks_checked_on_the_host():
    """The host's own check, one token per task, refuses a wider plan by its task (the matrices' alignment and
    queues are the verifier's: tests/test_stream_plan.py)."""
    from megakernel.stream_kernel import StreamKernelError, stream_k_classes
    cfg, plan = _stream_plan("tiny-dense")
    assert stream_k_classes(plan) == sorted({plan.task(i).fields["K"] for i in range(plan.num_tasks)
                                             if plan.task(i).op.name == "LINEAR"})
    _, wide = _stream_plan("tiny-dense", T=2)
    with pytest.raises(StreamKernelError, match="N=2"):
        stream_k_classes(wide)


# ---- on a GPU ----------------------------------------------------------------------------------------
def _gpu_setup(name, layers=None, max_len=256):
    from megakernel.runtime import Megakernel
    cfg, plan = _stream_plan(name, layers, torch.cuda.get_device_properties(0).multi_processor_count,
                             max_len=max_len)
    w = init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    mk = Megakernel(plan, w, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    mk.cache().copy_(torch.randn(mk.cache().shape, device="cuda", generator=g))
    return cfg, plan, mk


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name,layers", [("tiny-dense", None), ("llama-1b", 4), ("dsv2-lite", 2)])
def test_stream_kernel_equals_interpreter(name, layers):
    from megakernel.interpreter import Interpreter
    cfg, plan, mk = _gpu_setup(name, layers)
    interp = Interpreter(plan, None, "cuda", share=mk.mem)
    saved = mk.cache().clone()
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    lens = torch.tensor([200 if cfg.vocab_size > 1000 else 40], device="cuda")
    want = interp.step(tokens, lens)
    launched = None
    for replay in (False, True):  # a launch, then a captured graph's replay: the same bits
        mk.cache().copy_(saved)
        if replay:
            mk.capture()
        got = mk.step(tokens, lens)
        assert rel_err(got.logits, want.logits) <= BF16_TOL
        if replay:
            assert torch.equal(got.logits, launched)
        else:
            launched = got.logits.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stream_task_stall_is_a_watchdog_error_then_recovers():
    cfg, plan, mk = _gpu_setup("tiny-dense", max_len=64)
    mk.capture()
    stream_task = plan.queue_ptr[mk.body_workers]  # the first stream worker's first task
    stall_is_a_watchdog_error_then_recovers(mk, stream_task, torch.ones(1, 1, dtype=torch.long, device="cuda"),
                                            torch.tensor([5], device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stream_kernel_steps_are_bit_identical_on_dsv2_lite():
    """The same step 96 times (64 launches, then graph replays): every op writes the same bits.  Before session 30's
    fix (ring slots released a step late), ~5% of dsv2-lite's steps had one shared-expert down task differ: this
    draw would have caught it with probability ~0.99 (tools/step_diff.py, docs/PERF.md sessions 29-30)."""
    from tools.step_diff import step_diff
    report = step_diff("dsv2-lite", 2, stream_kernel=True, steps=96, launches=64)
    assert report["differing_steps"] == {}, report
