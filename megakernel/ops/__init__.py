"""Task bodies, one op family per module: each opcode's reference semantics (run by the plan
interpreter, in PyTorch) beside its GPU body.  REFERENCE maps opcode names to the reference."""

from __future__ import annotations

from . import (argmax, attention, elementwise, embed, head_matmul, helper, helper_side, linear, mhc, moe, norm, rope,
               spec)

REFERENCE = {
    "EMBED": embed.reference,
    "RMSNORM": norm.reference,
    "LINEAR": linear.reference,
    "EWISE": elementwise.reference,
    "ROPE_TABLE": rope.reference_table,
    "ROPE": rope.reference_apply,
    "CACHE_WRITE": rope.reference_cache_write,
    "HEAD_MATMUL": head_matmul.reference,
    "ATTENTION": attention.reference,
    "ATTN_COMBINE": attention.reference_combine,
    "ROUTE": moe.reference_route,
    "EXPERT_LINEAR": moe.reference_expert,
    "MOE_COMBINE": moe.reference_combine,
    "HC_COEFF": mhc.reference_coeff,
    "HC_EXPAND": mhc.reference_expand,
    "HC_HEAD": mhc.reference_head,
    "ARGMAX": argmax.reference,
    "ACCEPT": spec.reference_accept,
    "GATHER": spec.reference_gather,
    "HELPER_CALL": helper.reference_call,
    "HELPER_WAIT": helper.reference_wait,
    "HELPER_RECV": helper_side.reference_recv,
    "HELPER_SEND": helper_side.reference_send,
}
