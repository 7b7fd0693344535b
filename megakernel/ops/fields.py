"""Word positions of every opcode's fields, flag bits and opcode numbers, as Triton constants.

Generated from graph/isa.py so the kernel and the compiler cannot disagree:
`LINEAR_X_OFF` is the word index of LINEAR's `x.off`, `FLAG_LINEAR_RES` the bit of
flag RES, `OP_LINEAR` the opcode number.
"""

from __future__ import annotations

import triton.language as tl

from graph import isa
from graph.isa import LAYOUTS, OPCODES

WORD_OPCODE = tl.constexpr(0)
WORD_FLAGS = tl.constexpr(1)
WORD_SIGNAL = tl.constexpr(2)
WORD_WAITS = tl.constexpr(3)  # (counter, count) pairs from here
WORD_TILE = tl.constexpr(11)
# a helper call site's mailbox (graph.isa.box_layout) and the expert-map value of a helper's expert
BOX_SEQ, BOX_ACK, BOX_WAIT_NS = tl.constexpr(isa.BOX_SEQ), tl.constexpr(isa.BOX_ACK), tl.constexpr(isa.BOX_WAIT_NS)
BOX_PASSED = tl.constexpr(isa.BOX_PASSED)
BOX_HEADER, ON_HELPER = tl.constexpr(isa.BOX_HEADER), tl.constexpr(isa.ON_HELPER)
BOX_T_PUB, BOX_T_ANSWER = tl.constexpr(isa.BOX_T_PUB), tl.constexpr(isa.BOX_T_ANSWER)
BOX_T_ACKED = tl.constexpr(isa.BOX_T_ACKED)
CTL_DONE = tl.constexpr(isa.CTL_DONE)
__all__ = ["WORD_OPCODE", "WORD_FLAGS", "WORD_SIGNAL", "WORD_WAITS", "WORD_TILE", "BOX_SEQ", "BOX_ACK", "BOX_WAIT_NS",
           "BOX_HEADER", "ON_HELPER", "BOX_T_PUB", "BOX_T_ANSWER", "BOX_T_ACKED", "CTL_DONE", "BOX_PASSED"]
for _name, _op in OPCODES.items():
    globals()[f"OP_{_name}"] = tl.constexpr(_op.code)
    globals()[f"{_name}_FLAGS"] = tl.constexpr(1)
    __all__ += [f"OP_{_name}", f"{_name}_FLAGS"]
    for _i, _flag in enumerate(_op.flags):
        globals()[f"FLAG_{_name}_{_flag}"] = tl.constexpr(1 << _i)
        __all__.append(f"FLAG_{_name}_{_flag}")
    for _field, _pos in LAYOUTS[_name].items():
        key = f"{_name}_{_field.replace('.', '_').upper()}"
        globals()[key] = tl.constexpr(_pos)
        __all__.append(key)
