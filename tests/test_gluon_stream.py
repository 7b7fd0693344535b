"""tools/gluon_stream.py: the warp-specialized Gluon GEMV chain (issue 4's technique comparison).

On a CPU: the tile-major packing and the task table, replayed in Python the way the kernel reads
them, equal the chain in torch; the kernel compiles for sm_90 (Gluon has no interpreter, so this is
where frontend, layout and ptxas errors show).  On a GPU: the kernel's outputs equal torch's, with
the waits (a chain) and without, for irregular shapes and more tasks than workers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import gluon_stream as gs

# N and K off the tile sizes (tails everywhere), each K <= the previous N (a chain), K a multiple of 8
SHAPES = [(300, 296), (40, 296), (24, 40), (296, 24)]


def tma_tiles(chain: gs.Chain, task: list[int], row_major: bool) -> torch.Tensor:
    """The [tiles, ROWS, COLS] weights the producer streams for one task, addressed as the kernel does:
    tile-major rows of the arena, or a box at (row0, c x COLS) of the row-major arena viewed as
    [arena / K, K] with what lies past the view zero-filled, as a TMA does."""
    R, C = gs.TILE_ROWS, gs.TILE_COLS
    tile0, ntiles, k, kclass, row0 = task[0], task[1], task[3], task[10], task[11]
    if not row_major:
        return chain.arena[tile0 * R:(tile0 + ntiles) * R].view(ntiles, R, C).float()
    assert chain.klasses[kclass] == k
    view = chain.rowmajor[: chain.rowmajor.numel() // k * k].view(-1, k).float()
    box = torch.zeros(R, ntiles * C)
    rows = view[row0: row0 + R, :]
    box[: rows.shape[0], : min(k, ntiles * C)] = rows[:, : ntiles * C]
    return box.view(R, ntiles, C).permute(1, 0, 2)


def replay(chain: gs.Chain, act: torch.Tensor, row_major: bool = False) -> None:
    """The kernel's arithmetic from the task table alone, in queue order (valid: each task waits for
    every task of the previous GEMV, and queue order is GEMV order)."""
    order = sorted(range(chain.tasks.shape[0]), key=lambda t: int(chain.tasks[t, 6]))
    for t in order:
        task = chain.tasks[t].tolist()
        ntiles, x_off, k, y_off, nrows = task[1:6]
        C = gs.TILE_COLS
        tiles = tma_tiles(chain, task, row_major)
        x = torch.zeros(ntiles * C)
        x[:k] = act[x_off:x_off + k]
        y = torch.einsum("trc,tc->r", tiles, x.view(ntiles, C))
        act[y_off:y_off + nrows] = y[:nrows]


@pytest.mark.parametrize("row_major", [False, True])
@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("workers", [1, 3])
def test_task_table_replays_the_chain(chained, workers, row_major):
    chain = gs.build_chain(SHAPES, workers, chained, "cpu", sub=2)
    assert int(chain.queue[-1]) == chain.tasks.shape[0] == sum(-(-n // gs.TILE_ROWS) for n, _ in SHAPES)
    for w in range(workers):  # each queue in GEMV order: a task never waits on a later one
        gemvs = chain.tasks[int(chain.queue[w]):int(chain.queue[w + 1]), 6].tolist()
        assert gemvs == sorted(gemvs)
    x0 = torch.randn(max(k for _, k in SHAPES))
    act = torch.zeros(chain.act_size)
    act[:x0.numel()] = x0
    replay(chain, act, row_major)
    for out, ref in zip([act[o:o + n] for o, (n, _) in zip(chain.y_off, SHAPES)], gs.reference(chain, x0, chained)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_independent_gemvs_are_the_unchained_build_on_the_same_arenas():
    chained = gs.build_chain(SHAPES, 3, True, "cpu", sub=2)
    free = gs.build_chain(SHAPES, 3, False, "cpu", sub=2)
    derived = gs.independent(chained)
    assert torch.equal(derived.tasks, free.tasks) and derived.x_off == free.x_off
    assert derived.arena is chained.arena and derived.rowmajor is chained.rowmajor


def test_tile_major_keeps_every_weight():
    w = torch.randn(37, 517).to(torch.bfloat16)
    tiles = gs.tile_major(w)
    nr, nk = -(-37 // gs.TILE_ROWS), -(-517 // gs.TILE_COLS)
    R, C = gs.TILE_ROWS, gs.TILE_COLS
    back = tiles.view(nr, nk, R, C).permute(0, 2, 1, 3).reshape(nr * R, nk * C)
    assert torch.equal(back[:37, :517], w) and not back[37:].any() and not back[:, 517:].any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")
@pytest.mark.parametrize("chained", [True, False])
def test_triton_kernel_under_the_interpreter_equals_the_chain(chained):
    """The comparison's plain-Triton side (ops/linear.py's body in the same skeleton), one worker (the
    interpreter runs programs one after another, so a second one's waits would never be met)."""
    chain = gs.build_chain(SHAPES, 1, chained, "cpu")
    run = gs.ChainRun(chain, 1, chained, gs.Variant.parse("triton:8x64"))
    x0 = torch.randn(max(k for _, k in SHAPES))
    for _ in range(2):  # a second launch: the counters only grow
        run.act.zero_()
        run.act[:x0.numel()] = x0
        run.launch()
        run.check_error()
        for out, ref in zip(run.outputs(), gs.reference(chain, x0, chained)):
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_variants_parse_and_refuse():
    assert gs.Variant.parse("gluon:6x4") == gs.Variant("gluon", 6, 4, 4)
    assert gs.Variant.parse("triton:16x1024").warps == 8
    assert gs.Variant.parse("gluonrm:6x4").sub == 4 and gs.Variant.parse("triton:16x1024").sub == 1
    assert gs.Variant.parse("mma:16x512") == gs.Variant("mma", 16, 512, 8) and not gs.Variant.parse("mmas:16x512").gluon
    assert gs.Variant.parse("tma:8x256") == gs.Variant("tma", 8, 256, 8) and gs.Variant.parse("tmaw:4x64").b == 64
    assert gs.Variant.parse("tmaf:7x4").sub == 4 and gs.Variant.parse("tmaf:25x1").warps == 8
    for bad in ("gluon:6", "cublas:1x1", "triton:ax4", "mma:8x512", "mmas:16x256", "tma:1x256", "tma:8x2048",
                "tma:64x256", "tmaw:8x1024", "tmaf:1x4", "tmaf:8x4", "tmaf:4x3"):
        with pytest.raises(ValueError, match="variant"):
            gs.Variant.parse(bad)
    with pytest.raises(ValueError, match="multiple of 1024"):  # the tensor-core stream's steps
        gs.ChainRun(gs.build_chain(SHAPES, 1, True, "cpu"), 1, True, gs.Variant.parse("mma:16x512"))
    # four buffers of 512-column steps: Llama-1B's K of 2048 and 8192 are whole turns, 1024 is not
    llama = gs.build_chain(gs.LLAMA_1B, 1, True, "cpu")
    gs.ChainRun(llama, 1, True, gs.Variant.parse("mmas:16x2048"))
    with pytest.raises(ValueError, match="multiple of 2048"):
        gs.ChainRun(gs.build_chain([(1024, 1024)], 1, True, "cpu"), 1, True, gs.Variant.parse("mma:16x2048"))


def test_compiles_for_sm90():
    """In a process without TRITON_INTERPRET (the suite's interpreter would wrap the kernel)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[1] / "tools" / "gluon_stream.py"
    out = subprocess.run([sys.executable, str(tool), "--compile-only", "--variants", "gluon:6x4", "gluonrm:6x4",
                          "mma:16x512", "mmas:16x512", "mmas:16x2048", "tma:8x256", "tmaw:8x256", "tmaf:6x4"],
                         capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the tensor-core stream, two steps a loop turn: 2 x 2 tiles x 2 halves x (high, low) mma.sync, and the
    # weight loads of the first two steps (before the wait) and of the two steps after
    for kind in ("mma", "mmas"):
        assert f"{kind}:16x512, 16 mma.sync, 16 weight loads" in out.stdout, out.stdout
    assert "mmas:16x2048, 32 mma.sync, 32 weight loads" in out.stdout, out.stdout  # four buffers, four steps a turn
    # the plain-Triton TMA ring: Triton's pipeliner issues 7 tiles ahead (its prologue) and one a loop turn; with
    # the wait in the first turn (tmaw) all 7 are requested before it
    assert "tma:8x256, 8 TMA loads," in out.stdout, out.stdout
    assert "tmaw:8x256, 8 TMA loads (7 before the wait)" in out.stdout, out.stdout
    # one ring over all of a worker's tasks: 5 slots of 4 tiles requested ahead of the first task's wait
    assert "tmaf:6x4, 6 TMA loads (5 before the wait), shared 16" in out.stdout, out.stdout
    shared = int(re.search(r"shared (\d+) bytes", out.stdout).group(1))
    assert 6 * 4 * 8192 <= shared <= 227 * 1024, "the ring must fit an H200 SM's shared memory"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("spec", ["gluon:3x1", "gluon:4x2", "gluonrm:4x2", "triton:16x1024", "tma:4x256", "tma:3x64",
                                  "tmaw:4x256", "tmaw:2x64", "tmaw:3x1024", "tmaf:3x1", "tmaf:4x2", "tmaf:2x4"])
def test_gpu_chain_equals_torch(chained, spec):
    shapes = SHAPES * 3
    workers = 5  # more tasks than workers, fewer than tasks of one GEMV
    v = gs.Variant.parse(spec)
    chain = gs.build_chain(shapes, workers, chained, "cuda", sub=v.sub)
    run = gs.ChainRun(chain, workers, chained, v)
    x0 = torch.randn(max(k for _, k in shapes), device="cuda")
    ref = gs.reference(chain, x0, chained)
    for _ in range(3):  # replays: the counters only grow
        run.act.zero_()
        run.act[:x0.numel()] = x0
        run.launch()
        torch.cuda.synchronize()
        run.check_error()
        for out, r in zip(run.outputs(), ref):
            torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)


# the tensor-core stream's shapes: every K a multiple of its two 512-column steps, N off the 16-row tiles
MMA_SHAPES = [(2100, 1024), (1100, 2048), (1030, 1024), (13, 1024)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
@pytest.mark.parametrize("chained", [True, False])
def test_gpu_mma_chain_equals_torch(chained):
    """tools/mma_stream.py through the chain: x's (high, low) bf16 pair keeps ~16 mantissa bits, so the sums are
    torch's fp32 ones within 1e-4, bit-identical from launch to launch; split in the body (mma) or by the
    producer (mmas), the same split, so the same bits."""
    workers = 7
    chain = gs.build_chain(MMA_SHAPES, workers, chained, "cuda")
    x0 = torch.randn(max(k for _, k in MMA_SHAPES), device="cuda")
    ref = gs.reference(chain, x0, chained)
    results = {}
    for spec in ("mma:16x512", "mmas:16x512"):
        run = gs.ChainRun(chain, workers, chained, gs.Variant.parse(spec))
        for _ in range(3):
            run.set_input(x0)
            run.launch()
            torch.cuda.synchronize()
            run.check_error()
            outs = [o.clone() for o in run.outputs()]
            for out, r in zip(outs, ref):
                torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
            results.setdefault(spec, outs)
            assert all(torch.equal(a, b) for a, b in zip(outs, results[spec])), spec
    assert all(torch.equal(a, b) for a, b in zip(results["mma:16x512"], results["mmas:16x512"]))
