"""Hyper-connections: HC_COEFF (mix, activation, Sinkhorn, collapse), HC_EXPAND, HC_HEAD.

Coefficient row layout: [pre (n) | post (n) | comb (n·n, row-major, comb[j, k]: stream j into k)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.reference.mhc import (
    sinkhorn,  # the opcode's Sinkhorn is the model's, by definition
)

from .common import ffld, fld, has, off
from .fields import (
    FLAG_HC_COEFF_ACT,
    FLAG_HC_COEFF_COLLAPSE,
    FLAG_HC_COEFF_MIX,
    FLAG_HC_COEFF_SINK,
    HC_COEFF_BASE_OFF,
    HC_COEFF_COEF_BUF,
    HC_COEFF_COEF_OFF,
    HC_COEFF_CRAW_BUF,
    HC_COEFF_CRAW_OFF,
    HC_COEFF_EPS,
    HC_COEFF_FLAGS,
    HC_COEFF_FN_OFF,
    HC_COEFF_H,
    HC_COEFF_HC_EPS,
    HC_COEFF_ITERS,
    HC_COEFF_MIX_BUF,
    HC_COEFF_MIX_OFF,
    HC_COEFF_N,
    HC_COEFF_OUT_LD,
    HC_COEFF_OUT_OFF,
    HC_COEFF_R0,
    HC_COEFF_R1,
    HC_COEFF_SCALE_OFF,
    HC_COEFF_ST_LD,
    HC_COEFF_ST_OFF,
    HC_EXPAND_COEF_OFF,
    HC_EXPAND_H,
    HC_EXPAND_N,
    HC_EXPAND_OUT_LD,
    HC_EXPAND_OUT_OFF,
    HC_EXPAND_R0,
    HC_EXPAND_R1,
    HC_EXPAND_ST_LD,
    HC_EXPAND_ST_OFF,
    HC_EXPAND_SUB_LD,
    HC_EXPAND_SUB_OFF,
    HC_HEAD_BASE_OFF,
    HC_HEAD_EPS,
    HC_HEAD_FN_OFF,
    HC_HEAD_H,
    HC_HEAD_HC_EPS,
    HC_HEAD_N,
    HC_HEAD_OUT_LD,
    HC_HEAD_OUT_OFF,
    HC_HEAD_R0,
    HC_HEAD_R1,
    HC_HEAD_SCALE_OFF,
    HC_HEAD_ST_LD,
    HC_HEAD_ST_OFF,
)


def _normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    return streams * torch.rsqrt(streams.square().mean(-1, keepdim=True) + eps)


def reference_coeff(task, mem) -> None:
    r0, r1, n, H = task["r0"], task["r1"], task["n"], task["H"]
    R, width = r1 - r0, (2 + n) * n
    streams = mem.mat(task, "st", R, n * H, row0=r0).float() if (task.has("MIX") or task.has("COLLAPSE")) else None
    mix = craw = coef = None
    if task.has("MIX"):
        mix = _normed(streams, task["eps"]) @ mem.mat(task, "fn", width, n * H, ld=n * H).float().T
        if mem.present(task, "mix"):
            mem.mat(task, "mix", R, width, row0=r0, ld=width).copy_(mix)
    if task.has("ACT"):
        if mix is None:
            mix = mem.mat(task, "mix", R, width, row0=r0, ld=width).float()
        base, scale = mem.flat(task, "base", 0, width), mem.flat(task, "scale", 0, 3)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + task["hc_eps"]
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(R, n, n), dim=-1) + task["hc_eps"]
        craw = torch.cat((pre, post, comb.reshape(R, n * n)), dim=1)
        if mem.present(task, "craw"):
            mem.mat(task, "craw", R, width, row0=r0, ld=width).copy_(craw)
    if task.has("SINK"):
        if craw is None:
            craw = mem.mat(task, "craw", R, width, row0=r0, ld=width).float()
        comb = sinkhorn(craw[:, 2 * n:].view(R, n, n), task["iters"], task["hc_eps"])
        coef = torch.cat((craw[:, :2 * n], comb.reshape(R, n * n)), dim=1)
        if mem.present(task, "coef"):
            mem.mat(task, "coef", R, width, row0=r0, ld=width).copy_(coef)
    if task.has("COLLAPSE"):
        if coef is None:
            coef = mem.mat(task, "coef", R, width, row0=r0, ld=width).float()
        pre = coef[:, :n]
        mem.mat(task, "out", R, H, row0=r0).copy_((pre[:, :, None] * streams.view(R, n, H)).sum(1))


def reference_expand(task, mem) -> None:
    r0, r1, n, H = task["r0"], task["r1"], task["n"], task["H"]
    R, width = r1 - r0, (2 + n) * n
    streams = mem.mat(task, "st", R, n * H, row0=r0).float().view(R, n, H)
    sub = mem.mat(task, "sub", R, H, row0=r0).float()
    coef = mem.mat(task, "coef", R, width, row0=r0, ld=width).float()
    post, comb = coef[:, n:2 * n], coef[:, 2 * n:].view(R, n, n)
    new = post[:, :, None] * sub[:, None, :] + torch.einsum("rjk,rjh->rkh", comb, streams)
    mem.mat(task, "out", R, n * H, row0=r0).copy_(new.reshape(R, n * H))


def reference_head(task, mem) -> None:
    r0, r1, n, H = task["r0"], task["r1"], task["n"], task["H"]
    R = r1 - r0
    streams = mem.mat(task, "st", R, n * H, row0=r0).float()
    mix = _normed(streams, task["eps"]) @ mem.mat(task, "fn", n, n * H, ld=n * H).float().T
    pre = torch.sigmoid(mix * mem.flat(task, "scale", 0, 1) + mem.flat(task, "base", 0, n)) + task["hc_eps"]
    mem.mat(task, "out", R, H, row0=r0).copy_((pre[:, :, None] * streams.view(R, n, H)).sum(1))


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def _mix(st_row, fn, width, nH, eps, BW: tl.constexpr, BD: tl.constexpr):
    """rmsnorm(streams) @ fn.T -> [BW] (lanes >= width are 0)."""
    j = tl.arange(0, BW)
    sq = tl.zeros((BD,), tl.float32)
    for cb in range(0, nH, BD):
        c = cb + tl.arange(0, BD)
        v = tl.load(st_row + c, mask=c < nH, other=0.0, cache_modifier=".cg")
        sq += v * v
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / nH + eps)
    acc = tl.zeros((BW,), tl.float32)
    for cb in range(0, nH, BD):
        c = cb + tl.arange(0, BD)
        cm = c < nH
        v = tl.load(st_row + c, mask=cm, other=0.0, cache_modifier=".cg") * inv
        f = tl.load(fn + j[:, None].to(tl.int64) * nH + c[None, :], mask=(j[:, None] < width) & cm[None, :], other=0.0)
        acc += tl.sum(f * v[None, :], axis=1)
    return acc


@triton.jit
def _pick(vec, lanes, i):
    return tl.sum(tl.where(lanes == i, vec, 0.0), axis=0)


@triton.jit
def _collapse(st_row, pre, lanes, n, H, out_row, BD: tl.constexpr):
    """out = sum_i pre[i] · stream_i, the n streams of one row laid out one after another."""
    for cb in range(0, H, BD):
        h = cb + tl.arange(0, BD)
        hm = h < H
        acc = tl.zeros((BD,), tl.float32)
        for i in range(n):
            acc += _pick(pre, lanes, i) * tl.load(st_row + i * H + h, mask=hm, other=0.0, cache_modifier=".cg")
        tl.store(out_row + h, acc, mask=hm)


@triton.jit
def coeff_body(word, WF, A, BW: tl.constexpr, BD: tl.constexpr):
    flags, n, H = fld(word, HC_COEFF_FLAGS), fld(word, HC_COEFF_N), fld(word, HC_COEFF_H)
    width, nH = (2 + n) * n, n * H
    eps, hc_eps, iters = ffld(word, HC_COEFF_EPS), ffld(word, HC_COEFF_HC_EPS), fld(word, HC_COEFF_ITERS)
    st, st_ld = A + off(word, HC_COEFF_ST_OFF), fld(word, HC_COEFF_ST_LD)
    fn, base = WF + off(word, HC_COEFF_FN_OFF), WF + off(word, HC_COEFF_BASE_OFF)
    scale = WF + off(word, HC_COEFF_SCALE_OFF)
    mix_p, craw_p = A + off(word, HC_COEFF_MIX_OFF), A + off(word, HC_COEFF_CRAW_OFF)
    coef_p = A + off(word, HC_COEFF_COEF_OFF)
    o_ptr, o_ld = A + off(word, HC_COEFF_OUT_OFF), fld(word, HC_COEFF_OUT_LD)
    j = tl.arange(0, BW)
    jm = j < width
    for r in range(fld(word, HC_COEFF_R0), fld(word, HC_COEFF_R1)):
        if has(flags, FLAG_HC_COEFF_MIX):
            v = _mix(st + r * st_ld, fn, width, nH, eps, BW, BD)
            if fld(word, HC_COEFF_MIX_BUF) >= 0:
                tl.store(mix_p + r * width + j, v, mask=jm)
        else:
            v = tl.load(mix_p + r * width + j, mask=jm, other=0.0, cache_modifier=".cg")
        if has(flags, FLAG_HC_COEFF_ACT):
            b = tl.load(base + j, mask=jm, other=0.0)
            s = tl.where(j < n, tl.load(scale), tl.where(j < 2 * n, tl.load(scale + 1), tl.load(scale + 2)))
            z = v * s + b
            sig = 1.0 / (1.0 + tl.exp(-z))
            act = tl.where(j < n, sig + hc_eps, 2.0 * sig)
            c = j - 2 * n
            for row in range(n):  # softmax of each row of comb
                in_row = (c >= row * n) & (c < row * n + n)
                top = tl.max(tl.where(in_row, z, float("-inf")), axis=0)
                e = tl.where(in_row, tl.exp(z - top), 0.0)
                act = tl.where(in_row, e / tl.sum(e, axis=0) + hc_eps, act)
            v = tl.where(jm, act, 0.0)
            if fld(word, HC_COEFF_CRAW_BUF) >= 0:
                tl.store(craw_p + r * width + j, v, mask=jm)
        elif has(flags, FLAG_HC_COEFF_SINK):
            v = tl.load(craw_p + r * width + j, mask=jm, other=0.0, cache_modifier=".cg")
        if has(flags, FLAG_HC_COEFF_SINK):
            c = j - 2 * n
            is_comb = (c >= 0) & jm
            for it in range(2 * iters - 1):  # a column pass, then (row, column) pairs
                by_col = (it % 2) == 0
                for g in range(n):
                    sel = is_comb & tl.where(by_col, (c % n) == g, (c // n) == g)
                    total = tl.sum(tl.where(sel, v, 0.0), axis=0)
                    v = tl.where(sel, v / (total + hc_eps), v)
            if fld(word, HC_COEFF_COEF_BUF) >= 0:
                tl.store(coef_p + r * width + j, v, mask=jm)
        elif has(flags, FLAG_HC_COEFF_COLLAPSE):
            v = tl.load(coef_p + r * width + j, mask=jm, other=0.0, cache_modifier=".cg")
        if has(flags, FLAG_HC_COEFF_COLLAPSE):
            _collapse(st + r * st_ld, v, j, n, H, o_ptr + r * o_ld, BD)


@triton.jit
def expand_body(word, A, BW: tl.constexpr, BD: tl.constexpr):
    n, H = fld(word, HC_EXPAND_N), fld(word, HC_EXPAND_H)
    width = (2 + n) * n
    st, st_ld = A + off(word, HC_EXPAND_ST_OFF), fld(word, HC_EXPAND_ST_LD)
    sub, sub_ld = A + off(word, HC_EXPAND_SUB_OFF), fld(word, HC_EXPAND_SUB_LD)
    coef = A + off(word, HC_EXPAND_COEF_OFF)
    o_ptr, o_ld = A + off(word, HC_EXPAND_OUT_OFF), fld(word, HC_EXPAND_OUT_LD)
    j = tl.arange(0, BW)
    for r in range(fld(word, HC_EXPAND_R0), fld(word, HC_EXPAND_R1)):
        v = tl.load(coef + r * width + j, mask=j < width, other=0.0, cache_modifier=".cg")
        for cb in range(0, H, BD):
            h = cb + tl.arange(0, BD)
            hm = h < H
            s = tl.load(sub + r * sub_ld + h, mask=hm, other=0.0, cache_modifier=".cg")
            for kk in range(n):
                acc = _pick(v, j, n + kk) * s
                for i in range(n):
                    acc += _pick(v, j, 2 * n + i * n + kk) * tl.load(st + r * st_ld + i * H + h, mask=hm, other=0.0,
                                                                      cache_modifier=".cg")
                tl.store(o_ptr + r * o_ld + kk * H + h, acc, mask=hm)


@triton.jit
def head_body(word, WF, A, BW: tl.constexpr, BD: tl.constexpr):
    n, H, eps, hc_eps = fld(word, HC_HEAD_N), fld(word, HC_HEAD_H), ffld(word, HC_HEAD_EPS), ffld(word, HC_HEAD_HC_EPS)
    st, st_ld = A + off(word, HC_HEAD_ST_OFF), fld(word, HC_HEAD_ST_LD)
    fn, base = WF + off(word, HC_HEAD_FN_OFF), WF + off(word, HC_HEAD_BASE_OFF)
    scale = WF + off(word, HC_HEAD_SCALE_OFF)
    o_ptr, o_ld = A + off(word, HC_HEAD_OUT_OFF), fld(word, HC_HEAD_OUT_LD)
    j = tl.arange(0, BW)
    for r in range(fld(word, HC_HEAD_R0), fld(word, HC_HEAD_R1)):
        mix = _mix(st + r * st_ld, fn, n, n * H, eps, BW, BD)
        z = mix * tl.load(scale) + tl.load(base + j, mask=j < n, other=0.0)
        pre = 1.0 / (1.0 + tl.exp(-z)) + hc_eps
        _collapse(st + r * st_ld, pre, j, n, H, o_ptr + r * o_ld, BD)
