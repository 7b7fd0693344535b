"""tools/cokernel_chain.py: the GEMV chain with RMSNorms between its GEMVs, the GEMVs in the Gluon kernel and the
norms in a Triton kernel beside it.  On a CPU: the rewired task tables, replayed in the order their counters
allow, equal the chain in torch, and both kernels compile for sm_90 and fit one SM's shared memory together.
On a GPU: the two kernels side by side equal torch, launch after launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import cokernel_chain as cc
from tools import gluon_stream as gs

SHAPES = [(300, 296), (40, 296), (24, 40), (296, 24)] * 2


def replay(co: cc.CoChain, x0: torch.Tensor) -> list[torch.Tensor]:
    """Tasks run when their counter targets hold (one launch: epoch 1), GEMV tasks from their tile-major tiles
    and norm tasks as the Triton kernel computes them; every task must become runnable (no deadlock)."""
    act = torch.zeros(co.act_size)
    act[:x0.numel()] = x0
    counters = [0] * (co.counters.numel() // gs.STRIDE)
    pending = [("gemv", t) for t in co.tasks.tolist()] + [("norm", t) for t in co.norms.tolist()]
    while pending:
        ready = [p for p in pending if (p[0] == "gemv" and (p[1][6] == 0 or counters[p[1][6] - 1] >= p[1][7]))
                 or (p[0] == "norm" and counters[2 * p[1][0]] >= p[1][1])]
        assert ready, f"deadlock: {len(pending)} tasks wait, counters {counters}"
        for kind, t in ready:
            if kind == "gemv":
                tile0, ntiles, x_off, k, y_off, nrows = t[:6]
                tiles = co.chain.arena[tile0 * gs.TILE_ROWS:(tile0 + ntiles) * gs.TILE_ROWS].view(ntiles, gs.TILE_ROWS,
                                                                                                  gs.TILE_COLS)
                x = torch.zeros(ntiles * gs.TILE_COLS)
                x[:k] = act[x_off:x_off + k]
                act[y_off:y_off + nrows] = torch.einsum("trc,tc->r", tiles.float(), x.view(ntiles, -1))[:nrows]
                counters[t[6]] += 1
            else:
                j, _, y_off, z_off, k = t
                y = act[y_off:y_off + k]
                act[z_off:z_off + k] = y * torch.rsqrt(y.pow(2).mean() + cc.EPS)
                counters[2 * j + 1] += 1
            pending.remove((kind, t))
    return [act[o:o + n] for o, (n, _) in zip(co.chain.y_off, co.chain.shapes)]


@pytest.mark.parametrize("workers", [1, 5])
def test_rewired_tables_replay_the_normed_chain(workers):
    co = cc.CoChain(SHAPES, workers, "cpu", slots=3, sub=2)
    assert co.norms.shape[0] == len(SHAPES) - 1 and int(co.norm_queue[-1]) == len(SHAPES) - 1
    x0 = torch.randn(max(k for _, k in SHAPES))
    for out, ref in zip(replay(co, x0), cc.reference(co.chain, x0)):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_compiles_for_sm90_and_fits_one_sm():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[1] / "tools" / "cokernel_chain.py"
    out = subprocess.run([sys.executable, str(tool), "--compile-only"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shared, regs = (int(part.split()[0]) for part in out.stdout.split("together ")[1:3])
    assert shared <= cc.SM_SHARED and regs <= 65536, out.stdout
    # the launch kwarg's cap reached ptxas, and the two warpgroups' setmaxnreg share out no more than it gives the
    # CTA (a setmaxnreg.inc past the CTA's pool would block for ever)
    gluon_regs = int(re.search(r"gluon \d+ warps x (\d+)", out.stdout).group(1))
    setmax = [int(n) for n in re.search(r"setmaxnreg \[([\d, ]+)\]", out.stdout).group(1).split(",")]
    assert gluon_regs <= cc.GLUON_MAXNREG and max(setmax) + min(setmax) <= 2 * gluon_regs, out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
def test_gpu_side_by_side_kernels_equal_torch():
    workers = 5
    co = cc.CoChain(SHAPES * 2, workers, "cuda", slots=3, sub=2)
    x0 = torch.randn(max(k for _, k in SHAPES), device="cuda")
    ref = cc.reference(co.chain, x0)
    side = torch.cuda.Stream()
    for _ in range(3):  # launches: the counters only grow
        co.set_input(x0)
        co.launch(side)
        torch.cuda.synchronize()
        co.check_error()
        for out, r in zip(co.outputs(), ref):
            torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
