"""The plan interpreter: executes a plan's instruction words in PyTorch, exactly as the workers would.

Each worker runs its queue in order; a task starts only when each of its waits
is satisfied (counter >= epoch × count) and then signals its counter.  Queues
interleave either round-robin or in a random valid order, so any ordering bug
the verifier missed shows up as a mismatch.  Counters only grow: epoch e needs
e × count, so nothing is reset between steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from graph.isa import decode
from graph.plan import Plan

from .memory import Memory, PlanRunner
from .ops import REFERENCE


class InterpreterDeadlock(RuntimeError):
    pass


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, T, V]
    tokens: torch.Tensor  # [B, T] greedy next tokens
    hidden: torch.Tensor  # [B, T, H]
    mtp_logits: list[torch.Tensor]
    mtp_tokens: list[torch.Tensor]
    mtp_hidden: list[torch.Tensor]
    # speculative steps: drafts accepted per sequence, tokens emitted (-1 padded), the next step's
    # tokens (bonus token, then the new drafts) and cache lengths
    accepted: torch.Tensor | None = None
    emitted: torch.Tensor | None = None
    next_tokens: torch.Tensor | None = None
    next_lens: torch.Tensor | None = None


class Interpreter(PlanRunner):
    def __init__(self, plan: Plan, weights: dict[str, torch.Tensor] | None, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, share: Memory | None = None):
        self.plan = plan
        self.mem = Memory(plan, weights, device, dtype, share)
        self.tasks = [decode(w) for w in plan.words]
        self.counters = [0] * plan.num_counters
        self.epoch = 0
        self.trace: list[int] = []  # task ids in execution order of the last step
        # called before and after each step runs (the megakernel calls its own around a launch: the "after"
        # ones while the step runs): a helper's migration commits and decides there, on both runners at
        # the same points of a step
        self.launch_hooks: list = []
        self.after_launch_hooks: list = []

    def step(self, tokens: torch.Tensor, cache_lens: torch.Tensor, order: str = "queue",
             rng: random.Random | None = None, stop_after: int | None = None,
             follow: torch.Tensor | None = None, seeds: torch.Tensor | None = None) -> StepResult:
        """One decode step: tokens [B, T] at positions cache_lens[b] + t.  order: 'queue' or 'random'.
        follow (speculative prefill chunks): the token after each chunk, or -1."""
        check_step_inputs(self.plan, tokens, cache_lens)
        self.mem.io_view("in.tokens").copy_(tokens.reshape(-1, 1).to(torch.int32))
        self.mem.io_view("in.cache_lens").copy_(cache_lens.reshape(-1, 1).to(torch.int32))
        write_follow(self.mem, self.plan, follow, seeds)
        for hook in self.launch_hooks:
            hook()
        self.epoch += 1
        try:
            self._run(order, rng or random.Random(0), stop_after)
        except BaseException:  # KeyboardInterrupt too
            self._settle()  # a task raised (e.g. a helper timeout): the next step must still be able to run
            raise
        for hook in self.after_launch_hooks:
            hook()
        return self.result()

    def _settle(self) -> None:
        """Counters as if this epoch had completed, so the next step's waits mean what they should."""
        for t in self.tasks:
            self.counters[t.signal] = 0
        for t in self.tasks:
            self.counters[t.signal] += self.epoch

    def _ready(self, i: int) -> bool:
        return all(self.counters[c] >= self.epoch * n for c, n in self.tasks[i].waits)

    def _run(self, order: str, rng: random.Random, stop_after: int | None) -> None:
        plan = self.plan
        heads = [plan.queue_ptr[w] for w in range(plan.workers)]
        ends = [plan.queue_ptr[w + 1] for w in range(plan.workers)]
        self.trace = []
        remaining = plan.num_tasks
        while remaining:
            runnable = [w for w in range(plan.workers) if heads[w] < ends[w] and self._ready(heads[w])]
            if not runnable:
                stuck = [(w, plan.task_labels[heads[w]], self.tasks[heads[w]].waits) for w in range(plan.workers)
                         if heads[w] < ends[w]]
                raise InterpreterDeadlock(f"no worker can run; waiting: {stuck[:4]}")
            if order == "random":
                workers = [rng.choice(runnable)]
            else:
                workers = runnable
            for w in workers:
                i = heads[w]
                task = self.tasks[i]
                REFERENCE[task.op.name](task, self.mem)
                self.counters[task.signal] += 1
                self.trace.append(i)
                heads[w] += 1
                remaining -= 1
                if stop_after is not None and len(self.trace) >= stop_after:
                    return

    def result(self) -> StepResult:
        return read_outputs(self.mem, self.plan)


def check_step_inputs(plan: Plan, tokens: torch.Tensor, cache_lens: torch.Tensor) -> None:
    """The step's tokens have the plan's shape and are ids of its vocabulary (the kernel's EMBED would gather
    another tensor's bytes), the cache lengths are one per sequence and not negative, and every position the step
    writes fits the cache."""
    shape = plan.shape
    B, T, max_len = shape["B"], shape["T"], shape["max_len"]
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, the plan was compiled for ({B}, {T})")
    if cache_lens.numel() != B:
        raise ValueError(f"cache_lens has shape {tuple(cache_lens.shape)}: one length per sequence, the plan was "
                         f"compiled for {B}")
    vocab = plan.config["vocab_size"]
    # one read of the four bounds (a device sync where the inputs live on a GPU)
    lo, hi, shortest, longest = torch.stack([tokens.min().long(), tokens.max().long(), cache_lens.min().long(),
                                             cache_lens.max().long()]).tolist()
    if lo < 0 or hi >= vocab:
        raise ValueError(f"tokens hold ids {lo}..{hi}, outside the model's vocabulary 0..{vocab - 1}")
    if shortest < 0:
        raise ValueError(f"cache_lens holds a negative length ({shortest})")
    # MTP passes write past the step; a speculative step's drafts reach cache_len + a + T - 1 < cache_len + 2T
    extra = T if shape.get("speculative") else shape["mtp_passes"]
    if longest + T + extra > max_len:
        raise ValueError(f"cache_lens up to {longest} + T={T} + {extra} drafting positions exceeds the "
                         f"cache of {max_len} positions")


def write_follow(mem: Memory, plan: Plan, follow: torch.Tensor | None, seeds: torch.Tensor | None = None) -> None:
    """Speculative inputs: the token after a prefill chunk (or -1), and per-sequence sampling seeds."""
    B = plan.shape["B"]
    if "in.follow" in plan.io:
        value = torch.full((B, 1), -1, dtype=torch.int32) if follow is None else follow.reshape(B, 1).to(torch.int32)
        mem.io_view("in.follow").copy_(value)
    if "in.rng" in plan.io:
        if seeds is None:
            raise ValueError("a sampling plan needs per-sequence seeds for this step")
        mem.io_view("in.rng").copy_(seeds.reshape(B, 1).to(torch.int32))


def read_outputs(mem: Memory, plan: Plan) -> StepResult:
    """Copies of a step's outputs from a plan's buffers."""
    B, T = plan.shape["B"], plan.shape["T"]
    view = mem.io_view
    passes = plan.shape["mtp_passes"]
    spec = {}
    if plan.shape.get("speculative"):
        spec = dict(accepted=view("out.accepted").clone().view(B).long(),
                    emitted=view("out.emitted").clone().view(B, T).long(),
                    next_tokens=view("out.next_tokens").clone().view(B, T).long(),
                    next_lens=view("out.next_lens").clone().view(B).long())
    return StepResult(
        logits=view("out.logits").clone().view(B, T, -1),
        tokens=view("out.tokens").clone().view(B, T).long(),
        hidden=view("out.hidden").clone().view(B, T, -1),
        mtp_logits=[view(f"out.mtp{i}.logits").clone().view(B, T, -1) for i in range(passes)],
        mtp_tokens=[view(f"out.mtp{i}.tokens").clone().view(B, T).long() for i in range(passes)],
        mtp_hidden=[view(f"out.mtp{i}.hidden").clone().view(B, T, -1) for i in range(passes)],
        **spec,
    )
