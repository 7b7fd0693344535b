"""Host side of the megakernel: buffers, CUDA-graph capture, the watchdog.

One `Megakernel` runs one plan.  Before anything runs: the plan is verified, every
operand must sit in the buffer its role expects and the block sizes must fit the plan
(megakernel/launch.py), and the grid must fit on the device at once (workers <= SMs ×
co-resident programs per SM), else a clear error.  The first launch (JIT compile)
happens before capture; then a step is one graph replay: copy the step's tokens and
cache lengths from pinned staging, launch.
"""

from __future__ import annotations

import numpy as np
import torch

from graph.isa import MAX_WAITS, decode
from graph.plan import Plan
from graph.verify import verify_plan

from .interpreter import StepResult, check_step_inputs, read_outputs, write_follow
from .kernel import megakernel
# the launch configuration's names users import from here too (LaunchConfig, MegakernelError, ...)
from .launch import (INTERPRET, KERNEL_BUFFERS, LaunchConfig, MegakernelError, body_warps,  # noqa: F401
                     check_operand_buffers, cta_registers, host_inputs_refusal, kernel_constants, launch_blocks,
                     stream_workers, wait_bound_s)
from .ops import common
from .ops.helper import HELPER_TIMEOUT
from .memory import Memory, PlanRunner


class WatchdogError(MegakernelError):
    """A wait outlived its bound: names the stuck workers, tasks and counters."""


COUNTER_STRIDE = common.COUNTER_STRIDE.value
ERR_HEADER, ERR_PER_WORKER = common.ERR_HEADER.value, common.ERR_PER_WORKER.value


def stall_counter(plan: Plan) -> int:
    """The line past the plan's counters that nobody signals: the stall test hook (inject_stall) waits on it."""
    return plan.num_counters


def inputs_counter(plan: Plan) -> int:
    """The line after it: HIN's inputs counter, released by worker 0 once a step when the inputs are copied."""
    return plan.num_counters + 1


HOST_DESC_WORDS = 5  # host_input_slots' words, which the kernel's HIN prologue reads (HD)


def host_input_slots(plan: Plan, device) -> torch.Tensor:
    """[tokens' offset in I, tokens, cache lengths' offset in I, sequences, the inputs counter] (int32): where
    HIN's copies land, and the counter worker 0 releases when they have."""
    why = host_inputs_refusal(plan)
    if why is not None:
        raise MegakernelError(f"block override HIN=1: {why}")
    tok, lens = plan.io["in.tokens"], plan.io["in.cache_lens"]
    return torch.tensor([tok.offset, tok.rows, lens.offset, lens.rows, inputs_counter(plan)], dtype=torch.int32,
                        device=device)


class Megakernel(PlanRunner):
    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor] | None, device="cuda",
                 dtype: torch.dtype | None = None, share: Memory | None = None, config: LaunchConfig | None = None,
                 mem: Memory | None = None):
        """mem: buffers already built for this plan (a helper's site plan over its own expert store)."""
        tasks = [decode(w) for w in plan.words]  # once: verification, checks and block sizes all read them
        verify_plan(plan, tasks=tasks)
        check_operand_buffers(plan, tasks)
        self.plan, self.config = plan, config or LaunchConfig()
        self.device = torch.device(device)
        if self.device.type != "cuda" and not INTERPRET:
            raise MegakernelError("the megakernel needs a CUDA device (or TRITON_INTERPRET=1 for CPU tests)")
        self.mem = mem if mem is not None else Memory(plan, weights, self.device, dtype, share)
        self.words = torch.from_numpy(np.ascontiguousarray(plan.words)).to(self.device)
        self.queue_ptr = torch.tensor(plan.queue_ptr, dtype=torch.int32, device=self.device)
        # the plan's counters, then stall_counter and inputs_counter
        self.counters = torch.zeros((inputs_counter(plan) + 1) * COUNTER_STRIDE, dtype=torch.int32, device=self.device)
        self.worker_epoch = torch.zeros(plan.workers, dtype=torch.int32, device=self.device)
        self.err = torch.zeros(ERR_HEADER + ERR_PER_WORKER * plan.workers, dtype=torch.int32, device=self.device)
        self.prof = torch.zeros(max(1, plan.num_tasks) * 4 if self.config.profile else 4, dtype=torch.int64,
                                device=self.device)
        self.expected = np.bincount(plan.words[:, 2], minlength=plan.num_counters).astype(np.int64)
        self.wait_bound_s = wait_bound_s(tasks, self.config)
        self.epoch = 0
        self.blocks = launch_blocks(tasks, self.mem.dtype, self.config, plan)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled = None
        # a stream_kernel plan: its last queues hold the LINEAR tasks, run by a Gluon kernel beside this one
        self.body_workers = plan.workers - stream_workers(plan)
        self.num_warps = body_warps(plan, self.config)
        self.stream = None
        if self.body_workers < plan.workers:
            if self.device.type != "cuda":
                raise MegakernelError("this plan has stream workers (compiled with stream_kernel=1): their LINEAR "
                                      "tasks run in a Gluon kernel, which needs a CUDA device (Gluon has no "
                                      "interpreter); compile the plan without the option for TRITON_INTERPRET")
            from .stream_kernel import StreamKernel
            self.stream = StreamKernel(self, tasks)
            self.side = torch.cuda.Stream(self.device)
        self.launch_hooks: list = []  # called before every launch or replay (a helper service's wake-up)
        # called after every launch or replay, while the step runs (a helper's overlapped migration)
        self.after_launch_hooks: list = []
        self.diagnostics: list = []  # () -> str, added to a watchdog error (a helper service's failures)
        pinned = self.device.type == "cuda"
        B, T = plan.shape["B"], plan.shape["T"]
        self.stage_tokens = torch.zeros(B * T, 1, dtype=torch.int32, pin_memory=pinned)
        self.stage_lens = torch.zeros(B, 1, dtype=torch.int32, pin_memory=pinned)
        # HIN's slots; else a device stand-in the kernel never reads (a helper's site plan has no inputs)
        self.host_desc = (host_input_slots(plan, self.device) if self.host_inputs
                          else torch.zeros(HOST_DESC_WORDS, dtype=torch.int32, device=self.device))

    @property
    def host_inputs(self) -> bool:
        """HIN: the kernel copies the step's inputs from the stage buffers (no copy nodes)."""
        return bool(self.blocks["HIN"])

    # ---- launching -------------------------------------------------------------
    def _args(self):
        # HT, HL: the pinned stage buffers with HIN, else a device stand-in the kernel never reads
        stage = (self.stage_tokens, self.stage_lens) if self.host_inputs else (self.host_desc, self.host_desc)
        return (self.words, self.queue_ptr, self.counters, self.worker_epoch, self.err, self.prof,
                *(self.mem.bufs[b] for b in KERNEL_BUFFERS), *stage, self.host_desc)

    def _constexprs(self) -> dict:
        return kernel_constants(self.blocks, self.wait_bound_s, self.config, self.device.type == "cuda")

    def compile(self):
        """JIT-compile (never inside graph capture) and refuse grids that cannot all be resident."""
        if self.compiled is not None or INTERPRET:
            return self.compiled
        grid = (self.body_workers,)
        self.compiled = megakernel.warmup(*self._args(), **self._constexprs(), grid=grid,
                                          num_warps=self.num_warps, num_stages=self.config.num_stages)
        self.compiled._init_handles()
        props = torch.cuda.get_device_properties(self.device)
        per_sm = min(props.max_threads_per_multi_processor // (32 * self.num_warps),
                     props.regs_per_multiprocessor // cta_registers(self.compiled),
                     props.shared_memory_per_multiprocessor // max(1, self.compiled.metadata.shared))
        if self.body_workers > props.multi_processor_count * per_sm:
            raise MegakernelError(f"plan has {self.body_workers} workers but only {props.multi_processor_count} SMs "
                                  f"x {per_sm} resident programs fit ({self.compiled.n_regs} registers/thread, "
                                  f"{self.compiled.metadata.shared} B shared): refusing a launch that could hang")
        self.resident_per_sm = per_sm
        if self.stream is not None:  # both kernels loaded and checked to fit an SM together before either runs
            self.stream.compile(self.compiled)
        return self.compiled

    def kernel(self) -> None:
        """Issue the kernel on the current stream (compiled before; nothing else: a graph captures it)."""
        if self.stream is not None:  # beside a stream kernel: a fork and a join by events (two parallel graph nodes)
            main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(main)
        megakernel[(self.body_workers,)](*self._args(), **self._constexprs(), num_warps=self.num_warps,
                                         num_stages=self.config.num_stages)
        if self.stream is not None:
            with torch.cuda.stream(self.side):
                self.stream.kernel()
            main.wait_stream(self.side)

    def launch(self) -> None:
        self.compile()
        for hook in self.launch_hooks:
            hook()
        self.kernel()
        self.epoch += 1
        for hook in self.after_launch_hooks:
            hook()

    def _stage(self, tokens: torch.Tensor, cache_lens: torch.Tensor) -> None:
        check_step_inputs(self.plan, tokens, cache_lens)
        self.stage_tokens.copy_(tokens.reshape(-1, 1).to(torch.int32))
        self.stage_lens.copy_(cache_lens.reshape(-1, 1).to(torch.int32))

    def _inputs_to_device(self) -> None:
        if self.host_inputs:  # the kernel reads the stage buffers itself (HIN)
            return
        self.mem.io_view("in.tokens").copy_(self.stage_tokens, non_blocking=True)
        self.mem.io_view("in.cache_lens").copy_(self.stage_lens, non_blocking=True)

    def capture(self) -> None:
        """Record the launch (with HIN=0, the input copies first) into a CUDA graph.  Compiling happens
        before (warmup compiles without launching), and capture itself runs nothing: no step's state is touched."""
        self.compile()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._inputs_to_device()
            self.kernel()

    def replay(self) -> None:
        """One replay of the captured step (with the inputs staged last): a step, so the epoch the
        counters are checked against advances too.  Timing and launch counting replay through this."""
        for hook in self.launch_hooks:
            hook()
        self.graph.replay()
        self.epoch += 1
        for hook in self.after_launch_hooks:
            hook()

    def step(self, tokens: torch.Tensor, cache_lens: torch.Tensor, sync: bool = True,
             follow: torch.Tensor | None = None, seeds: torch.Tensor | None = None) -> StepResult | None:
        self._stage(tokens, cache_lens)
        write_follow(self.mem, self.plan, follow, seeds)
        if self.graph is not None:
            self.replay()
        else:
            self._inputs_to_device()
            self.launch()
        if not sync:
            return None
        if self.device.type == "cuda":
            # the step's stream, not the device: a helper's expert copies run beside the steps on their
            # own stream and must not hold up the step after the one they started behind
            torch.cuda.current_stream(self.device).synchronize()
        self.check_error()
        return self.result()

    def result(self) -> StepResult:
        return read_outputs(self.mem, self.plan)

    # ---- watchdog ----------------------------------------------------------------
    def check_error(self) -> None:
        err = self.err.cpu().numpy()
        if err[0] == 0:
            return
        lines = []
        for w in range(self.plan.workers):
            reason, task, counter, seen, target = err[ERR_HEADER + ERR_PER_WORKER * w:
                                                      ERR_HEADER + ERR_PER_WORKER * (w + 1)]
            if reason:
                what = "timed out" if reason == 1 else "stopped"
                label = (self.plan.task_labels[task] if 0 <= task < self.plan.num_tasks
                         else "before its first task" if task == -1 else "?")
                if reason == HELPER_TIMEOUT.value:
                    lines.append(f"worker {w} timed out at task {task} ({label}): the helper did not answer call "
                                 f"{target} within {self.config.helper_timeout_s} s (last answer: call {seen})")
                    continue
                counter_label = (self.plan.counter_labels[counter] if 0 <= counter < self.plan.num_counters
                                 else "the stall test counter" if counter == stall_counter(self.plan)
                                 else "the step's inputs, copied from the host by worker 0 (HIN)")
                lines.append(f"worker {w} {what} at task {task} ({label}) waiting for counter {counter} "
                             f"({counter_label}) to reach {target}, saw {seen}")
        lines.sort(key=lambda s: "stopped" in s)
        self.repair()
        bound = f"{self.wait_bound_s} s" if self._constexprs()["USE_TIMER"] else f"{self.config.max_spins} polls"
        extra = "".join(f"; {d}" for d in (diagnose() for diagnose in self.diagnostics) if d)
        raise WatchdogError(f"megakernel watchdog: a wait exceeded {bound} in step {self.epoch}; "
                            + "; ".join(lines[:6]) + (f"; and {len(lines) - 6} more" if len(lines) > 6 else "")
                            + extra)

    def repair(self) -> None:
        """Make the counters consistent with a completed step so the next step can run."""
        c = torch.from_numpy(self.expected * self.epoch).to(torch.int32)
        view = self.counters[: self.plan.num_counters * COUNTER_STRIDE].view(-1, COUNTER_STRIDE)
        view[:, 0] = c.to(self.device)
        self.counters[inputs_counter(self.plan) * COUNTER_STRIDE] = self.epoch  # one a step
        self.err.zero_()

    def inject_stall(self, task: int) -> callable:
        """Test hook: make `task` wait on a counter nobody signals; returns a function that undoes it."""
        original = self.words[task].clone()
        # the first free wait slot (waits fill the slots from the first: graph.isa.encode; WAITS=1 stops reading at
        # the first empty one), else the last
        slot = 3 + 2 * min(len(decode(original.tolist()).waits), MAX_WAITS - 1)
        self.words[task, slot] = stall_counter(self.plan)
        self.words[task, slot + 1] = 1

        def undo():
            self.words[task] = original
        return undo
