"""Mixture of experts: the router (softmax or grouped sigmoid with correction bias) and the experts."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .layers import swiglu_mlp


def route(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (fp32) -> (weights [N, k] fp32, expert ids [N, k] int64).

    greedy: top-k of the scores.  group_limited_greedy: top-k inside the
    topk_group groups with the highest best-expert score (DeepSeek-V2).
    noaux_tc: groups ranked by the sum of their two best biased scores, experts
    chosen by biased score, weighted by unbiased score (DeepSeek-V3).
    """
    N, E = logits.shape
    k = cfg.num_experts_per_tok
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if (cfg.topk_method != "noaux_tc" or bias is None) else scores + bias.float()
    if cfg.topk_method != "greedy":
        groups = choice.view(N, cfg.n_group, E // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = groups.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def router_logits(w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w[p + "gate.weight"].float())


def moe(cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    """Routed experts (grouped by expert, each expert's weights used once) plus shared experts.

    x [N, H] -> [N, H]; expert outputs accumulate in fp32.
    """
    weights, ids = route(cfg, router_logits(w, p, x), w.get(p + "gate.e_score_correction_bias"))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // ids.shape[1]
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        rows = tokens[start:start + count]
        slot_weights = weights.flatten()[order[start:start + count]]
        e = f"{p}experts.{expert}."
        y = swiglu_mlp(x[rows], w[e + "gate_proj.weight"], w[e + "up_proj.weight"], w[e + "down_proj.weight"])
        out.index_add_(0, rows, y.float() * slot_weights[:, None])
        start += count
    if cfg.n_shared_experts:
        s = p + "shared_experts."
        out += swiglu_mlp(x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]).float()
    return out.to(x.dtype)
