"""HEAD_MATMUL: a small matmul per attention head (MLA's absorbed W_UK and W_UV)."""

from __future__ import annotations

import torch


def reference(task, mem) -> None:
    N, i_dim, o_dim = task["N"], task["in_dim"], task["out_dim"]
    w_buf = mem.bufs[task["w.buf"]]
    for h in range(task["h0"], task["h1"]):
        x = mem.mat(task, "x", N, i_dim, col0=h * task["x_hs"] + task["x_col0"]).float()
        base = task["w.off"] + h * task["w_hs"]
        if task.has("TRANS"):  # W_h[i, o] at o*ld + i
            w = w_buf.as_strided((o_dim, i_dim), (task["w_ld"], 1), base).float().T
        else:
            w = w_buf.as_strided((i_dim, o_dim), (task["w_ld"], 1), base).float()
        mem.mat(task, "out", N, o_dim, col0=h * task["out_hs"]).copy_(x @ w)
