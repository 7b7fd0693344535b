"""Hyper-connections: HC_COEFF (mix, activation, Sinkhorn, collapse), HC_EXPAND, HC_HEAD.

Coefficient row layout: [pre (n) | post (n) | comb (n·n, row-major, comb[j, k]: stream j into k)].
"""

from __future__ import annotations

import torch


def _normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    return streams * torch.rsqrt(streams.square().mean(-1, keepdim=True) + eps)


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


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
