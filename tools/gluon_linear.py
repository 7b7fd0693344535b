"""The megakernel's LINEAR task in Gluon: the warp-specialized ring of tools/gluon_stream.py with LINEAR's
epilogues (NORM, SILU_MUL over a gate and an up matrix, RES) over row-major weights, on Llama-1B's layer.

    python tools/gluon_linear.py [--layers 16] [--variants 6x4 12x2 ...] [--iters 30] [--out DIR] [--compile-only]

Why: gluon_stream's ring is the only weight stream faster than cuBLAS on Llama-1B's GEMV chain (docs/PERF.md
session 19), but its tasks are bare GEMVs over tile-major weights.  A Gluon LINEAR body, whichever way the
megakernel adopts it (a whole Gluon port, or a Gluon kernel for the streamed ops beside the Triton one:
tools/cokernel_chain.py), must also read the arena as the megakernel lays it out (row-major, each matrix on
its own) and do what megakernel/ops/linear.py does after the sums:
- NORM: the task scales its sums by rsqrt(mean(x^2) + eps), x's RMSNorm with the weight folded into W;
- SILU_MUL: gate and up rows from two matrices, silu(x @ Wg.T * r) * (x @ Wu.T * r);
- RES: a residual row added.
Per layer, as the engine's plan has them: qkv (3072 x 2048, NORM), o (2048 x 2048, RES: the layer's input),
gate|up (2 x 8192 x 2048, NORM + SILU_MUL), down (2048 x 8192, RES); o reads qkv's first 2048 outputs in place of
attention's.  Tasks of 16 output rows; each op waits for the whole previous one (the chain) or for nothing
(every op reads a fixed input: the stream's ceiling).

Addressing: each matrix starts at a multiple of its K in one bf16 arena, so one TMA descriptor per distinct K
views the arena as [arena / K, K] and a task's tile is the box at (its first row, c x 256), the TMA zero-filling
columns past K (gluon_stream's gluonrm).  The producer streams a task's gate tiles, then its up tiles.
Checked against torch in fp32 (the same bf16 weights) before timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.ops.linear_ring import fill_slots, norm_scale  # noqa: E402
from tools import gluon_stream as gs  # noqa: E402

ROWS, COLS = gs.ROWS, gs.COLS  # a tile: 16 rows x 256 columns of bf16, one TMA box
FIELDS = gl.constexpr(12)  # kclass, gate row, up row, K, tiles, x, out, residual offsets, rows, flags, op, its
#                            predecessor's task count
F_NORM, F_SILU, F_RES = 1, 2, 4  # a task's flag bits, as LINEAR's NORM, SILU_MUL and RES
NORM, SILU, RES = gl.constexpr(F_NORM), gl.constexpr(F_SILU), gl.constexpr(F_RES)  # the same, for the kernel
EPS = 1e-5
LAYER = [("qkv", 3072, 2048, F_NORM), ("o", 2048, 2048, F_RES), ("gate_up", 8192, 2048, F_NORM | F_SILU),
         ("down", 2048, 8192, F_RES)]


@gluon.jit
def _producer(d0, d1, d2, d3, tasks, queue, ring, ready, empty, SLOTS: gl.constexpr, SUB: gl.constexpr):
    """The worker's tasks' tiles in queue order, SLOTS slots of SUB tiles ahead of the consumers; a SILU_MUL
    task's gate tiles, then its up tiles.  It never waits on a dependency counter."""
    pid = gl.program_id(0)
    it = 0
    for t in range(gl.load(queue + pid), gl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        kclass, ntiles = gl.load(task), gl.load(task + 4)
        mats = 1 + ((gl.load(task + 9) & SILU) != 0).to(gl.int32)
        for m in range(mats):
            it = fill_slots(d0, d1, d2, d3, kclass, gl.load(task + 1 + m), ntiles, ring, ready, empty, it, SLOTS, SUB)


@gluon.jit
def _consumer(tasks, queue, counters, epoch_ptr, err, act, ring, ready, empty, WAIT: gl.constexpr,
              SLOTS: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr, EPS_C: gl.constexpr):
    """Each task: wait for the previous op, its norm scale (NORM), its gate (or only) and up sums from the ring,
    the epilogue, a store of its rows, the signal."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows = gl.arange(0, ROWS, gl.SliceLayout(1, tile_l))
    pid = gl.program_id(0)
    epoch, ok = gs.launch_epoch(epoch_ptr, err)
    it = 0
    for t in range(gl.load(queue + pid), gl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        K = (gl.load(task + 3) // 8) * 8  # multiples of 8 (the host checks): 16-byte activation loads
        ntiles = gl.load(task + 4)
        x_ptr = act + (gl.load(task + 5) // 8) * 8
        flags = gl.load(task + 9)
        op = gl.load(task + 10)
        if WAIT:
            if op > 0:
                if ok:
                    ok = gs._wait(counters + (op - 1) * gs.COUNTER_STRIDE, epoch * gl.load(task + 11), err)
        r = 1.0
        if (flags & NORM) != 0:
            r = norm_scale(x_ptr, K, EPS_C, WARPS)
        y, it = gs.tile_sums(ring, ready, empty, it, x_ptr, K, ntiles, SLOTS, SUB, WARPS)
        y = y * r
        if (flags & SILU) != 0:
            u, it = gs.tile_sums(ring, ready, empty, it, x_ptr, K, ntiles, SLOTS, SUB, WARPS)
            y = y / (1.0 + gl.exp(-y)) * (u * r)
        mask = (rows < gl.load(task + 8)) & ok
        if (flags & RES) != 0:
            y += gl.load(act + gl.load(task + 7) + rows, mask=mask, other=0.0)
        gl.store(act + gl.load(task + 6) + rows, y, mask=mask)
        gl.thread_barrier()  # every consumer's stores before the release
        gl.atomic_add(counters + op * gs.COUNTER_STRIDE, 1, sem="release", scope="gpu")


@gluon.jit
def linear_chain_kernel(d0, d1, d2, d3, tasks, queue, counters, epoch_ptr, err, act, WAIT: gl.constexpr,
                        SLOTS: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr, EPS_C: gl.constexpr):
    ring, ready, empty = gs.ring_buffers(d0, SLOTS, SUB)
    gl.warp_specialize([(_consumer, (tasks, queue, counters, epoch_ptr, err, act, ring, ready, empty, WAIT, SLOTS,
                                     SUB, WARPS, EPS_C)),
                        (_producer, (d0, d1, d2, d3, tasks, queue, ring, ready, empty, SLOTS, SUB))], [1], [40])


# ---- host ----------------------------------------------------------------------------------------
@dataclass
class Op:
    name: str
    rows: int
    K: int
    flags: int
    w: list  # [rows, K] bf16: the gate (or only) matrix, then up
    x_off: int
    out_off: int
    res_off: int


@dataclass
class LinearChain:
    ops: list
    arena: torch.Tensor  # row-major, each matrix at a multiple of its K
    tasks: torch.Tensor  # [tasks, FIELDS] int32, in queue order
    queue: torch.Tensor  # [workers + 1]
    klasses: list
    act_size: int

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * 2 for op in self.ops for w in op.w)


def build(layers: int, workers: int, chained: bool, device, seed: int = 0, layer=LAYER, sub: int = 1) -> LinearChain:
    """Random weights ~N(0, 1/K) (activations stay ~1), the activation regions of each op, tasks of 16 rows
    round-robin from where the previous op's ended (each queue in op order: no deadlock).  layer: (name, rows,
    K, flags) of one layer's ops; chained, each op reads the previous op's output and RES adds the residual
    stream (the last RES op's output, at first the input)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ops, base = [], max(K for _, _, K, _ in layer)  # act[0:max K]: the chain's input
    h = 0

    def region(n: int) -> int:
        nonlocal base
        at, base = base, base + -(-n // 8) * 8
        return at
    for _ in range(layers):
        for name, rows, K, flags in layer:
            mats = 2 if flags & F_SILU else 1
            w = [(torch.randn(rows, K, generator=g, device=device) / K ** 0.5).to(torch.bfloat16) for _ in range(mats)]
            # unchained, every op reads the input (x and residual): nothing it reads is written during the launch
            x_off = ops[-1].out_off if ops and chained else 0
            res = (h if chained else 0) if flags & F_RES else -1
            out = region(rows)
            ops.append(Op(name, rows, K, flags, w, x_off, out, res))
            if flags & F_RES:
                h = out  # the residual stream: the next RES op adds this op's output
    for prev, op in zip(ops, ops[1:]):
        if chained and op.K > prev.rows:
            raise ValueError(f"gluon_linear: {op.name} reads K={op.K} entries of {prev.name}'s {prev.rows} outputs")
    width = ops[0].K  # the residual stream's: the input's, then each residual op's rows
    for op in ops:
        if op.flags & F_RES and op.rows != width:
            raise ValueError(f"gluon_linear: {op.name} adds a residual of {width} rows to its {op.rows}")
    klasses = sorted({op.K for op in ops})
    if len(klasses) > gs.MAX_K_CLASSES or any(op.K % 8 for op in ops):
        raise ValueError(f"gluon_linear: at most {gs.MAX_K_CLASSES} distinct K, each a multiple of 8: {klasses}")
    starts, end = [], 0
    for op in ops:
        for _ in op.w:
            starts.append(-(-end // op.K) * op.K)
            end = starts[-1] + op.rows * op.K
    arena = torch.zeros(end + gs.STREAM_SLACK, dtype=torch.bfloat16, device=device)
    per_worker, wk, i = [[] for _ in range(workers)], 0, 0
    for j, op in enumerate(ops):
        view_rows = [starts[i + m] // op.K for m in range(len(op.w))]
        for m, w in enumerate(op.w):
            arena[starts[i + m]: starts[i + m] + w.numel()] = w.reshape(-1)
        i += len(op.w)
        prev_tasks = -(-ops[j - 1].rows // ROWS.value) if j > 0 else 0
        for r0 in range(0, op.rows, ROWS.value):
            per_worker[wk].append([klasses.index(op.K), view_rows[0] + r0, view_rows[-1] + r0, op.K,
                                   -(-op.K // (COLS.value * sub)) * sub, op.x_off, op.out_off + r0,
                                   op.res_off + r0 if op.res_off >= 0 else 0, min(ROWS.value, op.rows - r0), op.flags,
                                   j, prev_tasks])
            wk = (wk + 1) % workers
    table = [t for q in per_worker for t in q]
    queue = torch.tensor([0] + [len(q) for q in per_worker]).cumsum(0).to(torch.int32)
    return LinearChain(ops, arena, torch.tensor(table, dtype=torch.int32, device=device), queue.to(device), klasses,
                       base)


def reference(chain: LinearChain, x0: torch.Tensor) -> list[torch.Tensor]:
    """Each op in fp32 from the same bf16 weights, reading the activations the kernel reads."""
    act = torch.zeros(chain.act_size, device=x0.device)
    act[:x0.numel()] = x0
    outs = []
    for op in chain.ops:
        x = act[op.x_off: op.x_off + op.K]
        r = torch.rsqrt(x.pow(2).mean() + EPS) if op.flags & F_NORM else 1.0
        y = (op.w[0].float() @ x) * r
        if op.flags & F_SILU:
            y = torch.nn.functional.silu(y) * ((op.w[1].float() @ x) * r)
        if op.flags & F_RES:
            y = y + act[op.res_off: op.res_off + op.rows]
        act[op.out_off: op.out_off + op.rows] = y
        outs.append(y)
    return outs


def descriptors(chain: LinearChain) -> list:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    views = [chain.arena[: chain.arena.numel() // k * k].view(-1, k) for k in chain.klasses]
    descs = [TensorDescriptor.from_tensor(v, [ROWS.value, COLS.value], layout) for v in views]
    return descs + descs[:1] * (gs.MAX_K_CLASSES - len(descs))


class Run:
    def __init__(self, chain: LinearChain, workers: int, wait: bool, slots: int, sub: int, warps: int = 4):
        dev = chain.arena.device
        self.chain, self.workers, self.wait, self.slots, self.sub, self.warps = chain, workers, wait, slots, sub, warps
        self.descs = descriptors(chain)
        self.counters = torch.zeros(len(chain.ops) * gs.STRIDE, dtype=torch.int32, device=dev)
        self.epochs = torch.zeros(workers, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.act = torch.zeros(chain.act_size, dtype=torch.float32, device=dev)

    def set_input(self, x0: torch.Tensor) -> None:
        self.act.zero_()
        self.act[:x0.numel()] = x0

    def launch(self) -> None:
        linear_chain_kernel[(self.workers,)](*self.descs, self.chain.tasks, self.chain.queue, self.counters,
                                             self.epochs, self.err, self.act, WAIT=self.wait, SLOTS=self.slots,
                                             SUB=self.sub, WARPS=self.warps, EPS_C=EPS, num_warps=self.warps)

    def check_error(self) -> None:
        if int(self.err.item()):
            raise RuntimeError(f"gluon_linear: a dependency wait ran past MAX_SPINS polls "
                               f"(counters {self.counters[::gs.STRIDE].tolist()})")

    def outputs(self) -> list[torch.Tensor]:
        return [self.act[op.out_off: op.out_off + op.rows] for op in self.chain.ops]


def compile_sm90(slots: int, sub: int, warps: int = 4, wait: bool = True):
    """The kernel compiled for an H100/H200 on any machine (Gluon has no interpreter: a CPU's check)."""
    return gs.compile_ring_kernel_sm90(linear_chain_kernel, {"WAIT": wait, "SLOTS": slots, "SUB": sub,
                                                             "WARPS": warps, "EPS_C": EPS}, warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--variants", nargs="*", default=["6x4", "12x2", "3x8"], metavar="SLOTSxSUB")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=".")
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed), print its sizes")
    args = p.parse_args()
    variants = [tuple(int(v) for v in spec.split("x")) for spec in args.variants]
    if args.compile_only:
        for slots, sub in variants:
            k = compile_sm90(slots, sub)
            assert "cp.async.bulk.tensor" in k.asm["ptx"] and "mbarrier.try_wait" in k.asm["ptx"]
            print(f"sm_90: {slots}x{sub}, shared {k.metadata.shared} bytes, ptx {len(k.asm['ptx'])} chars")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gluon_linear times a Gluon kernel: it needs a GPU (Gluon has no interpreter)")
    from tools.bench import read_bandwidth, time_ms
    props = torch.cuda.get_device_properties(0)
    workers = props.multi_processor_count
    bw = read_bandwidth()
    x0 = torch.randn(max(K for _, _, K, _ in LAYER), device="cuda")
    rows = []
    for sub in sorted({s for _, s in variants}):
        for wait in (True, False):
            chain = build(args.layers, workers, wait, "cuda", sub=sub)
            ref = reference(chain, x0)
            for slots, s in [v for v in variants if v[1] == sub]:
                run = Run(chain, workers, wait, slots, s)
                run.set_input(x0)
                run.launch()
                torch.cuda.synchronize()
                run.check_error()
                err = max(float((o - r).norm() / r.norm()) for o, r in zip(run.outputs(), ref))
                ms = time_ms(gs.graph_of(run.launch).replay, iters=args.iters, warmup=5)
                run.check_error()
                rows.append({"variant": f"{slots}x{s}", "waits": wait, "ms": ms, "TBps": chain.nbytes / ms / 1e9,
                             "rel_err": err})
                print(rows[-1], flush=True)
            nbytes = chain.nbytes
            del chain, run
    floor = nbytes / bw * 1e3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_linear.json").write_text(json.dumps({"gpu": props.name, "layers": args.layers, "bytes": nbytes,
                                                       "read_TBps": bw / 1e12, "floor_ms": floor, "rows": rows},
                                                      indent=1))
    print(f"{props.name}: {args.layers} layers of LINEAR tasks, {nbytes / 1e9:.3f} GB; floor {floor:.3f} ms")
    for r in sorted(rows, key=lambda r: not r["waits"]):
        print(f"gluon linear {r['variant']:<6}{str(r['waits']):>6}{r['ms']:>9.3f} ms{r['TBps']:>7.2f} TB/s"
              f"{r['ms'] / floor:>7.2f}x floor   rel err {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
