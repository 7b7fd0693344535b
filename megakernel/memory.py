"""Device memory of a plan: the buffers tasks address, and typed views into them.

Buffers are flat tensors: W (model-dtype weight arena), WF (fp32 weights and
constants), A (fp32 activations), I (int32), C (the cache, [layers, B, S, width]), H (int32
mailboxes of helper plans, in host memory the GPU maps).
Weights are packed into the arenas at the offsets the plan chose.
"""

from __future__ import annotations

import torch

from graph.ir import TRANSPOSED
from graph.isa import Buf, Decoded
from graph.plan import Plan
from model.config import ModelConfig
from model.weights import resolve_shared


# Elements past the W arena's end a weight chunk may read: the weight stream loads whole chunks of KC
# columns unmasked (ops/linear.weight_rows), so the last matrix's last row reads up to KC - 1 past it.
STREAM_SLACK = 8192


class Memory:
    """Buffers for one plan.  `share` reuses another Memory's weights and cache (plans of one
    model for other T have the same weight layout and cache shape; this is checked)."""

    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor] | None, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, share: "Memory | None" = None):
        cfg = ModelConfig.from_hf_dict(plan.config)
        self.cfg, self.shape, self.io = cfg, plan.shape, plan.io
        self.device = torch.device(device)
        sizes = plan.buffers
        acts = {
            Buf.A: torch.full((max(1, sizes["A"]),), float("nan"), dtype=torch.float32, device=self.device),
            Buf.I: torch.full((max(1, sizes["I"]),), -7, dtype=torch.int32, device=self.device),
            Buf.H: mailboxes(sizes.get("H", 0), self.device),
        }
        if share is not None:
            if share.layout != weight_layout(plan):
                raise ValueError("plans do not share a weight layout and cache shape; cannot share buffers")
            self.dtype, self.layout = share.dtype, share.layout
            self.bufs = {**{b: share.bufs[b] for b in (Buf.W, Buf.WF, Buf.C)}, **acts}
            return
        w = resolve_shared(cfg, weights)
        self.dtype = dtype or w["model.embed_tokens.weight"].dtype
        self.layout = weight_layout(plan)
        self.bufs: dict[int, torch.Tensor] = {
            Buf.W: torch.zeros(sizes["W"] + STREAM_SLACK, dtype=self.dtype, device=self.device),
            Buf.WF: torch.zeros(max(1, sizes["WF"]), dtype=torch.float32, device=self.device),
            Buf.C: torch.zeros(max(1, sizes["C"]), dtype=self.dtype, device=self.device),
            **acts,
        }
        for slot in plan.weights:
            arena = self.bufs[slot.buf]
            for hf_name, rel, *scale in slot.parts:
                transposed = scale == [TRANSPOSED]
                scale = [] if transposed else scale
                for name in (hf_name, *scale[:1]):
                    if name not in w:
                        raise KeyError(f"plan needs weight {name}, which the weights do not have")
                src = w[hf_name]
                if transposed:  # a down projection read k-major (expert_mlp, dense_mlp)
                    src = src.t().contiguous()
                if scale:  # a weight whose columns carry a norm's weight (fusion rule norm_into_linear)
                    src = scaled_part(src, w[scale[0]], scale[1] if len(scale) > 1 else "", arena.dtype)
                src = src.reshape(-1)
                arena[slot.offset + rel: slot.offset + rel + src.numel()] = src.to(arena.dtype)
        if not _all_finite(self.bufs[Buf.W]):
            # the weight stream reads past a matrix's end into its neighbour (ops/linear.weight_rows),
            # so one non-finite weight anywhere would reach another matrix's outputs (0 x inf)
            bad = [f"{s.name} ({hf})" for s in plan.weights if s.buf == Buf.W for hf, *_ in s.parts
                   if not _all_finite(w[hf].to(self.dtype))]
            raise ValueError(f"weight {', '.join(bad) or '(none by name)'} has non-finite values in {self.dtype}")
        for const in plan.consts:
            data = torch.tensor(const["data"], dtype=torch.float32)
            self.bufs[Buf.WF][const["offset"]: const["offset"] + data.numel()] = data

    # ---- typed access --------------------------------------------------------
    def mat(self, task: Decoded, key: str, rows: int, cols: int, row0: int = 0, col0: int = 0,
            ld: int | None = None) -> torch.Tensor:
        """A [rows, cols] view of operand `key` starting at (row0, col0)."""
        buf = self.bufs[task[key + ".buf"]]
        ld = task[key + ".ld"] if ld is None else ld
        return buf.as_strided((rows, cols), (ld, 1), task[key + ".off"] + row0 * ld + col0)

    def flat(self, task: Decoded, key: str, start: int, n: int) -> torch.Tensor:
        return self.bufs[task[key + ".buf"]].as_strided((n,), (1,), task[key + ".off"] + start)

    def present(self, task: Decoded, key: str) -> bool:
        return task[key + ".buf"] >= 0

    # ---- io ------------------------------------------------------------------
    def io_view(self, name: str) -> torch.Tensor:
        slot = self.io[name]
        return self.bufs[slot.buf].as_strided((slot.rows, slot.cols), (slot.cols, 1), slot.offset)

    def cache(self) -> torch.Tensor:
        """The cache as [layers, B, S, width] (the reference Cache's layout)."""
        s, cfg = self.shape, self.cfg
        n = cfg.num_layers_total * s["B"] * s["max_len"] * cfg.cache_width
        return self.bufs[Buf.C][:n].view(cfg.num_layers_total, s["B"], s["max_len"], cfg.cache_width)


def scaled_part(w: torch.Tensor, g: torch.Tensor, part: str, dtype: torch.dtype) -> torch.Tensor:
    """W·diag(g), in fp32 (a bf16 times a bf16 is exact there), or with part "hi" / "lo" its rounding to bf16
    (fp16 for an fp16 arena) / what that rounding left out, in fp32: packed into a bf16 arena hi + lo is
    W·diag(g) within the rounding of lo (~2^-16 of it), in an fp32 arena exactly.  The split is at bf16 in an
    fp32 arena too, so the CPU tests' fp32 models stream a low part that is not zero (fusion rule
    norm_beside_experts' router)."""
    full = w.float() * g.float()
    if part in ("hi", "lo"):
        hi = full.to(torch.float16 if dtype == torch.float16 else torch.bfloat16).float()
        return hi if part == "hi" else full - hi
    return full


def mailboxes(size: int, device: torch.device) -> torch.Tensor:
    """Buf.H: pinned host memory (a GPU reads and writes it over the bus, a host thread answers
    there); without mailboxes one word on the device, so the kernel's pointer is a device one."""
    if size == 0:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")


def _all_finite(t: torch.Tensor, chunk: int = 1 << 26) -> bool:
    """In chunks: a model-sized arena's boolean mask would cost half its size again."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def weight_layout(plan: Plan) -> tuple:
    # where each weight and constant lies, whatever order a plan lists them in (a plan lists those it
    # reads in its own order, derived weights among them)
    return (tuple(sorted((w.name, w.buf, w.offset) for w in plan.weights)),
            tuple(sorted((c["name"], c["offset"]) for c in plan.consts)),
            plan.buffers["W"], plan.buffers["WF"], plan.buffers["C"], plan.shape["B"], plan.shape["max_len"])


class PlanRunner:
    """What every runner of one plan (interpreter, megakernel) exposes: its plan, its Memory, the step shape."""

    plan: Plan
    mem: Memory

    @property
    def T(self) -> int:
        return self.plan.shape["T"]

    @property
    def B(self) -> int:
        return self.plan.shape["B"]

    def cache(self) -> torch.Tensor:
        return self.mem.cache()
