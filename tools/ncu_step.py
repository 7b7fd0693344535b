"""One megakernel step for Nsight Compute to sample: where inside the persistent kernel the warps stall.

    ncu --clock-control none -k regex:megakernel --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o OUT/mk \
        python tools/ncu_step.py --model dsv2-lite --cubin OUT/mk.cubin
    ncu --import OUT/mk.ncu-rep --page source --csv --print-source sass > OUT/mk_sass.csv
    python tools/ncu_lines.py OUT/mk_sass.csv OUT/mk.cubin      # samples per body and per source line

The per-task trace (`--profile`) says which tasks take long; the warp-state samples say why (a
spill, an instruction-cache miss, a barrier, a global load).  This script only builds the model's
T=1 plan on random weights and launches the kernel four times (the first compiles); `--cubin`
writes the compiled kernel so its SASS addresses can be mapped to Python source lines offline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph.compile import CompileOptions, compile_step  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from megakernel.runtime import Megakernel  # noqa: E402
from model import init_weights, preset  # noqa: E402
from tools.bench import launch_config, step_max_len  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dsv2-lite")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--variant", default="", metavar="KEY=V,...", help="launch variant (tools/bench.py --variants)")
    p.add_argument("--launches", type=int, default=4)
    p.add_argument("--cubin", default="", help="write the compiled kernel here")
    args = p.parse_args()
    cfg = preset(args.model)
    weights = init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=step_max_len(args.ctx, 1)),
                        CompileOptions(workers=torch.cuda.get_device_properties(0).multi_processor_count))
    mk = Megakernel(plan, weights, "cuda", torch.bfloat16, config=launch_config(args.variant))
    gen = torch.Generator(device="cuda").manual_seed(1)
    mk.cache().normal_(generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda", generator=gen)
    lens = torch.tensor([args.ctx - 1], device="cuda")
    for _ in range(args.launches):
        mk.step(tokens, lens)
    if args.cubin:
        Path(args.cubin).write_bytes(mk.compiled.asm["cubin"])
    print(f"{args.model}: {args.launches} launches, {plan.num_tasks} tasks, {mk.compiled.n_regs} registers, "
          f"{mk.compiled.n_spills} spills")


if __name__ == "__main__":
    main()
