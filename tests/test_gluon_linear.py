"""tools/gluon_linear.py: LINEAR's epilogues (NORM, SILU_MUL, RES) in the Gluon ring over row-major weights.

On a CPU: the task table, replayed in Python the way the producer addresses the arena (a box at (row, c x 256)
of the arena viewed as [arena / K, K], zero past the view) and the consumer finishes a task, equals the chain in
torch; the kernel compiles for sm_90.  On a GPU: the kernel's outputs equal torch's, chained and not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import gluon_linear as gli

# rows off the 16-row tiles, K off the 256-column tiles (multiples of 8, at most four distinct), each K at most
# the previous op's rows (a chain reads the first K of its input), the residual ops as wide as the input
LAYER = [("qkv", 300, 296, gli.F_NORM), ("o", 296, 296, gli.F_RES), ("gate_up", 40, 200, gli.F_NORM | gli.F_SILU),
         ("down", 296, 40, gli.F_RES)]


def box(chain: gli.LinearChain, kclass: int, row: int, ntiles: int) -> torch.Tensor:
    k = chain.klasses[kclass]
    view = chain.arena[: chain.arena.numel() // k * k].view(-1, k).float()
    out = torch.zeros(gli.ROWS.value, ntiles * gli.COLS.value)
    rows = view[row: row + gli.ROWS.value, : ntiles * gli.COLS.value]
    out[: rows.shape[0], : rows.shape[1]] = rows
    return out


def run_queues(chain: gli.LinearChain):
    """The tasks in an order the kernel may run them: each worker's queue in turn, as far as its next task's wait
    holds (op 0, or counter[op - 1] at its task count, field 11), each task adding 1 to counter[op] (field 10) as
    it ends; every task must run (no deadlock).  A wait's count set too low lets a task run before all of what it
    reads was written."""
    tasks, queue = chain.tasks.tolist(), chain.queue.tolist()
    nxt, counters, ran = queue[:-1], [0] * len(chain.ops), True
    while ran:
        ran = False
        for w in range(len(nxt)):
            while nxt[w] < queue[w + 1] and (tasks[nxt[w]][10] == 0
                                             or counters[tasks[nxt[w]][10] - 1] >= tasks[nxt[w]][11]):
                yield tasks[nxt[w]]
                counters[tasks[nxt[w]][10]] += 1
                nxt[w], ran = nxt[w] + 1, True
    assert nxt == queue[1:], f"deadlock: workers stopped at {nxt} of {queue[1:]}, counters {counters}"


def replay(chain: gli.LinearChain, x0: torch.Tensor) -> torch.Tensor:
    act = torch.zeros(chain.act_size)
    act[:x0.numel()] = x0
    for t in run_queues(chain):
        kclass, g_row, u_row, k, ntiles, x_off, out_off, res_off, nrows, flags = t[:10]
        x = torch.zeros(ntiles * gli.COLS.value)
        x[:k] = act[x_off: x_off + k]
        r = torch.rsqrt(act[x_off: x_off + k].pow(2).mean() + gli.EPS) if flags & gli.F_NORM else 1.0
        y = box(chain, kclass, g_row, ntiles) @ x * r
        if flags & gli.F_SILU:
            y = torch.nn.functional.silu(y) * (box(chain, kclass, u_row, ntiles) @ x * r)
        if flags & gli.F_RES:
            y = y + act[res_off: res_off + gli.ROWS.value]
        act[out_off: out_off + nrows] = y[:nrows]
    return act


@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("workers,sub", [(1, 1), (5, 2)])
def test_task_table_replays_the_chain(chained, workers, sub):
    chain = gli.build(2, workers, chained, "cpu", layer=LAYER, sub=sub)
    assert int(chain.queue[-1]) == chain.tasks.shape[0] == 2 * sum(-(-rows // 16) for _, rows, _, _ in LAYER)
    for w in range(workers):  # each queue in op order: a task never waits on a later one
        ops = chain.tasks[int(chain.queue[w]):int(chain.queue[w + 1]), 10].tolist()
        assert ops == sorted(ops)
    x0 = torch.randn(max(k for _, _, k, _ in LAYER))
    act = replay(chain, x0)
    for op, ref in zip(chain.ops, gli.reference(chain, x0)):
        torch.testing.assert_close(act[op.out_off: op.out_off + op.rows], ref, rtol=1e-4, atol=1e-5)


def test_a_chain_that_reads_past_its_input_is_refused():
    with pytest.raises(ValueError, match="gate_up reads K=304"):
        gli.build(1, 1, True, "cpu", layer=[("o", 296, 296, gli.F_RES), ("gate_up", 40, 304, gli.F_SILU)])
    with pytest.raises(ValueError, match="o adds a residual of 296 rows to its 200"):
        gli.build(1, 1, True, "cpu", layer=[("o", 200, 296, gli.F_RES)])


def test_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[1] / "tools" / "gluon_linear.py"
    out = subprocess.run([sys.executable, str(tool), "--compile-only", "--variants", "6x4", "3x1"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sm_90: 6x4, shared" in out.stdout and "sm_90: 3x1, shared" in out.stdout, out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("slots,sub", [(3, 1), (4, 2)])
def test_gpu_linear_chain_equals_torch(chained, slots, sub):
    workers = 5
    chain = gli.build(3, workers, chained, "cuda", layer=LAYER, sub=sub)
    x0 = torch.randn(max(k for _, _, k, _ in LAYER), device="cuda")
    ref = gli.reference(chain, x0)
    run = gli.Run(chain, workers, chained, slots, sub)
    for _ in range(3):  # launches: the counters only grow
        run.set_input(x0)
        run.launch()
        torch.cuda.synchronize()
        run.check_error()
        for out, r in zip(run.outputs(), ref):
            torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
