"""Two persistent kernels on every SM at once, one Gluon, one plain Triton, handing work to each other through
the same counters: can the megakernel keep its Triton bodies and take only the weight stream to Gluon?

    python tools/cokernel_chain.py [--layers 16] [--norm-warps 4] [--iters 30] [--out DIR] [--compile-only]

Why: the Gluon ring (tools/gluon_stream.py) is the only weight stream faster than cuBLAS on Llama-1B's GEMV chain
(0.70 ms against the LINEAR body's 0.82, docs/PERF.md session 19), but a plain @triton.jit body with tensors
does not compile inside a Gluon kernel, so a Gluon megakernel means porting every op body.  The alternative
tried here: a Gluon kernel that runs only the streamed tasks and a Triton kernel that runs the rest, both
persistent with one CTA per SM, co-resident (the Gluon CTA's 5 warps, launched as 8, and ~200 KB of shared memory
beside the Triton CTA's warps and registers), captured side by side in one CUDA graph (two streams).

The chain: gluon_stream's 64 GEMVs, with an RMSNorm between each GEMV and the next (z = y[:K'] *
rsqrt(mean(y[:K']^2) + eps), K' the next GEMV's K), run by the Triton kernel: GEMV j (Gluon, its tasks on every
worker) -> norm j (Triton, one task) -> GEMV j + 1.  Counters interleave: GEMV j signals counter 2j and waits
on 2j - 1, norm j waits on 2j and signals 2j + 1, so gluon_stream's kernel runs unchanged with its tasks' GEMV
field set to 2j.  Reported beside the same chain without norms (gluon_stream's), whose difference is the 63
norm tasks plus one cross-kernel hop each; in the megakernel an RMSNORM task spans ~2.5 us on a layer's chain.
If the two kernels do not co-reside, the first GEMV after a norm waits past MAX_SPINS and the error flag says so
(bounded waits: no hang).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.stream_kernel import largest_shared_split as _set_split  # noqa: E402
from tools import gluon_stream as gs  # noqa: E402


def largest_shared_split(kernel) -> None:
    """Both kernels at the SM's largest shared-memory split (an SM holds CTAs of one split: see the engine's)."""
    kernel._init_handles()  # the module loaded and kernel.function set, as a first launch would
    _set_split(kernel)

EPS = 1e-6
# the Gluon CTA's registers at launch: 8 warps (4 consumers, the producer's warpgroup) x 128 = half an SM's 64K,
# so a Triton CTA of 4 warps x up to 128 registers (the megakernel's 238 would need 4 x 238 = 30.5K) fits beside
# it; without the cap Gluon asks for 256 a thread, the whole register file, and nothing co-resides
GLUON_MAXNREG = 128
SM_SHARED = 228 * 1024 - 2 * 1024  # an H100/H200 SM's shared memory less the 1 KB the hardware keeps per CTA


@triton.jit
def norm_kernel(A, norms, queue, counters, epoch_ptr, err, FIELDS: tl.constexpr, STRIDE: tl.constexpr,
                BLOCK: tl.constexpr, EPS: tl.constexpr):
    """Worker w runs norm tasks queue[w]..queue[w+1]: each (GEMV index j, its task count, y offset, z offset,
    K') waits until GEMV j's counter (2j) reaches epoch x count, writes z = y[:K'] * rsqrt(mean(y[:K']^2) + eps)
    and signals counter 2j + 1."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    c = tl.arange(0, BLOCK)
    for t in range(tl.load(queue + pid), tl.load(queue + pid + 1)):
        task = norms + t * FIELDS
        j, count, k = tl.load(task), tl.load(task + 1), tl.load(task + 4)
        y_off, z_off = tl.load(task + 2), tl.load(task + 3)
        if gs._wait(counters + 2 * j * STRIDE, epoch * count, err):
            sq = tl.zeros((BLOCK,), tl.float32)
            for kb in range(0, k, BLOCK):
                v = tl.load(A + y_off + kb + c, mask=kb + c < k, other=0.0, cache_modifier=".cg")
                sq += v * v
            r = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / k + EPS)
            for kb in range(0, k, BLOCK):
                v = tl.load(A + y_off + kb + c, mask=kb + c < k, other=0.0, cache_modifier=".cg")
                tl.store(A + z_off + kb + c, v * r, mask=kb + c < k)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(counters + (2 * j + 1) * STRIDE, 1, sem="release", scope="gpu")


NORM_FIELDS = 5


class CoChain:
    """gluon_stream's chain re-wired for norms between GEMVs: each GEMV j > 0 reads z_{j-1} (its own region
    after the chain's activations) and waits on norm j - 1's counter; the norm tasks go round-robin over the
    Triton kernel's workers."""

    def __init__(self, shapes, workers: int, device, slots: int = 6, sub: int = 4, seed: int = 0):
        self.chain = gs.build_chain(shapes, workers, True, device, seed=seed, sub=sub)
        self.workers, self.slots, self.sub = workers, slots, sub
        c = self.chain
        z_off, base = [], c.act_size
        for _, k in shapes[1:]:
            z_off.append(base)
            base += -(-k // 8) * 8
        tasks = c.tasks.clone()
        gemv = tasks[:, 6].long()
        tasks[:, 6] = 2 * gemv  # signals counter 2j; waits on 2j - 1 (norm j - 1's)
        tasks[:, 7] = 1  # one norm task per GEMV
        later = gemv > 0
        tasks[later, 2] = torch.tensor(z_off, dtype=torch.int32, device=device)[gemv[later] - 1]
        self.tasks = tasks
        per_gemv = torch.bincount(gemv, minlength=len(shapes)).tolist()
        norms = [[j, per_gemv[j], c.y_off[j], z_off[j], shapes[j + 1][1]] for j in range(len(shapes) - 1)]
        order = sorted(range(len(norms)), key=lambda j: (j % workers, j))  # worker j % workers, in chain order
        self.norms = torch.tensor([norms[j] for j in order], dtype=torch.int32, device=device)
        counts = torch.bincount(torch.tensor([j % workers for j in range(len(norms))]), minlength=workers)
        self.norm_queue = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).to(device)
        self.act_size = base
        self.counters = torch.zeros(2 * len(shapes) * gs.STRIDE, dtype=torch.int32, device=device)
        self.epochs = torch.zeros(workers, dtype=torch.int32, device=device)
        self.norm_epochs = torch.zeros(workers, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.act = torch.zeros(base, dtype=torch.float32, device=device)
        self.alone = (torch.zeros_like(self.counters), torch.zeros_like(self.epochs))  # launch_alone's counters
        self._prepared = set()  # norm_warps values whose kernels prepare() has compiled and configured

    def set_input(self, x0: torch.Tensor) -> None:
        self.act.zero_()
        self.act[:x0.numel()] = x0

    def launch(self, side: torch.cuda.Stream, norm_warps: int = 4) -> None:
        """The Gluon kernel on the current stream and the Triton one on `side`, concurrently (a fork and a join
        by events, so a graph captures two parallel kernel nodes)."""
        self.prepare(norm_warps)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        self.launch_gluon(self.tasks, self.counters, self.epochs)
        with torch.cuda.stream(side):
            self.launch_norms(norm_warps)
        main.wait_stream(side)

    def prepare(self, norm_warps: int = 4) -> None:
        """Both kernels compiled, loaded and given the same shared-memory split before either first runs: a first
        launch() would otherwise compile the norm kernel while the Gluon one already spins on norm 0's counter."""
        if norm_warps not in self._prepared:
            largest_shared_split(self.launch_gluon(self.tasks, self.counters, self.epochs, warmup=True))
            largest_shared_split(self.launch_norms(norm_warps, warmup=True))
            self._prepared.add(norm_warps)

    def launch_norms(self, norm_warps: int, warmup: bool = False):
        """The Triton kernel on the current stream (warmup: compiled, not launched; its CompiledKernel returned)."""
        return norm_kernel.run(self.act, self.norms, self.norm_queue, self.counters, self.norm_epochs, self.err,
                               grid=(self.workers,), warmup=warmup, FIELDS=NORM_FIELDS, STRIDE=gs.STRIDE, BLOCK=1024,
                               EPS=EPS, num_warps=norm_warps)

    def launch_gluon(self, tasks, counters, epochs, warmup: bool = False):
        """gluon_stream's kernel on the current stream, capped at GLUON_MAXNREG registers (warmup: compiled only)."""
        return gs.gemv_chain_kernel.run(*self.descs, tasks, self.chain.queue, counters, epochs, self.err, self.act,
                                        grid=(self.workers,), warmup=warmup, WAIT=True, SLOTS=self.slots, SUB=self.sub,
                                        WARPS=4, RM=False, num_warps=4, maxnreg=GLUON_MAXNREG)

    def launch_alone(self) -> None:
        """The GEMVs without the norms (gluon_stream's chain: GEMV j reads y_{j-1}), same kernel and registers."""
        self.launch_gluon(self.chain.tasks, *self.alone)

    @property
    def descs(self):
        if not hasattr(self, "_descs"):
            self._descs = gs.descriptors(self.chain, False)
        return self._descs

    def check_error(self) -> None:
        if int(self.err.item()):
            raise RuntimeError("cokernel chain: a dependency wait ran past MAX_SPINS polls (the two kernels did not "
                               f"run side by side?): counters {self.counters[::gs.STRIDE].tolist()}")

    def outputs(self) -> list[torch.Tensor]:
        return [self.act[o:o + n] for o, (n, _) in zip(self.chain.y_off, self.chain.shapes)]


def reference(chain: gs.Chain, x0: torch.Tensor) -> list[torch.Tensor]:
    """Each GEMV in fp32 from the bf16 weights, its input the previous output's first K entries normalized."""
    outs, x = [], x0
    for j, (w, (n, k)) in enumerate(zip(chain.weights, chain.shapes)):
        if j > 0:
            x = x[:k] * torch.rsqrt(x[:k].pow(2).mean() + EPS)
        outs.append(w.float() @ x[:k])
        x = outs[-1]
    return outs


def compile_norm_sm90(warps: int = 4):
    """The Triton side compiled for sm_90a on any machine."""
    return gs._compile_triton_sm90(norm_kernel, {"A": "*fp32", "norms": "*i32", "queue": "*i32", "counters": "*i32",
                                                 "epoch_ptr": "*i32", "err": "*i32"},
                                   {"FIELDS": NORM_FIELDS, "STRIDE": gs.STRIDE, "BLOCK": 1024, "EPS": EPS}, warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--norm-warps", type=int, default=4)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=".")
    p.add_argument("--compile-only", action="store_true", help="compile both kernels for sm_90 (no GPU needed)")
    args = p.parse_args()
    if args.compile_only:
        k = compile_norm_sm90(args.norm_warps)
        g = gs.compile_sm90(6, 4, 4, maxnreg=GLUON_MAXNREG)
        # what ptxas gives each (the Gluon CTA's launch allocation, which its partitions' setmaxnreg share out),
        # allocated 8 a thread at a time
        gluon_regs, norm_regs = (-(-gs.ptxas_registers(x.asm["ptx"]) // 8) * 8 for x in (g, k))
        regs = g.metadata.num_warps * 32 * gluon_regs + args.norm_warps * 32 * norm_regs
        setmax = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", g.asm["ptx"])})
        print(f"sm_90a: norm kernel {k.metadata.shared} bytes shared; gluon:6x4 {g.metadata.shared} bytes shared, "
              f"together {k.metadata.shared + g.metadata.shared} of {SM_SHARED} two CTAs may have; registers "
              f"together {regs} of 65536 (gluon {g.metadata.num_warps} warps x {gluon_regs}, its warpgroups' "
              f"setmaxnreg {setmax}; norms {args.norm_warps} warps x {norm_regs})")
        return
    if not torch.cuda.is_available():
        raise SystemExit("cokernel_chain times Gluon and Triton kernels side by side: it needs a GPU")
    from tools.bench import time_ms
    props = torch.cuda.get_device_properties(0)
    workers = props.multi_processor_count
    shapes = gs.LLAMA_1B * args.layers
    nbytes = sum(n * k * 2 for n, k in shapes)
    x0 = torch.randn(max(k for _, k in shapes), device="cuda")
    co = CoChain(shapes, workers, "cuda")
    side = torch.cuda.Stream()
    rows = []
    co.set_input(x0)
    co.launch(side, args.norm_warps)
    torch.cuda.synchronize()
    co.check_error()
    err = max(float((o - r).norm() / r.norm()) for o, r in zip(co.outputs(), reference(co.chain, x0)))
    ms = time_ms(gs.graph_of(lambda: co.launch(side, args.norm_warps)).replay, iters=args.iters)
    co.check_error()
    rows.append({"kernel": "gluon:6x4 + triton norms", "ms": ms, "TBps": nbytes / ms / 1e9, "rel_err": err})
    # the same GEMVs, weights, kernel and registers without the norms (gluon_stream's chain)
    co.set_input(x0)
    co.launch_alone()
    torch.cuda.synchronize()
    co.check_error()
    err0 = max(float((o - r).norm() / r.norm()) for o, r in zip(co.outputs(), gs.reference(co.chain, x0, True)))
    ms0 = time_ms(gs.graph_of(co.launch_alone).replay, iters=args.iters)
    co.check_error()
    rows.append({"kernel": "gluon:6x4 alone", "ms": ms0, "TBps": nbytes / ms0 / 1e9, "rel_err": err0})
    hops = len(shapes) - 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cokernel_chain.json").write_text(json.dumps({"gpu": props.name, "gemvs": len(shapes), "rows": rows,
                                                         "us_per_norm": (ms - ms0) * 1e3 / hops}, indent=1))
    print(f"{props.name}: {len(shapes)} GEMVs, {nbytes / 1e9:.3f} GB, {hops} norms between them")
    for r in rows:
        print(f"{r['kernel']:<28}{r['ms']:>9.3f} ms{r['TBps']:>7.2f} TB/s   rel err {r['rel_err']:.1e}")
    print(f"each norm with its cross-kernel hops: {(ms - ms0) * 1e3 / hops:.2f} us on the chain")


if __name__ == "__main__":
    main()
