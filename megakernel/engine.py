"""The engine: prefill and greedy decode over a backend, optionally checked step by step against the reference.

Backends run one step of T tokens for B sequences at given cache lengths:
- `reference`: the unfused PyTorch model (model/reference);
- `interpret`: compiled plans run by the plan interpreter (one plan per T, all sharing weights and cache);
- `megakernel`: the same plans run by the persistent kernel, each step one CUDA-graph replay.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import random
import time
from dataclasses import dataclass, field

import torch

from graph.compile import CompileOptions, compile_step
from graph.lower import StepShape
from graph.plan import Plan
from model.config import ModelConfig
from model.reference import Cache, Reference

from .interpreter import Interpreter


@dataclass
class StepLogits:
    logits: torch.Tensor  # [B, T, V] fp32
    hidden: torch.Tensor  # [B, T, H]


class ReferenceBackend:
    name = "reference"

    def __init__(self, cfg: ModelConfig, weights, batch: int, max_len: int, device, dtype):
        self.ref = Reference(cfg, weights)
        self.cache = Cache.allocate(cfg, batch, max_len, dtype, device)

    def run(self, tokens: torch.Tensor, lens: torch.Tensor) -> StepLogits:
        out = self.ref.step(tokens, self.cache, lens)
        return StepLogits(out.logits, out.hidden)

    def cache_data(self) -> torch.Tensor:
        return self.cache.data


class InterpreterBackend:
    """Compiled plans run by the plan interpreter.  One runner per step shape, compiled on first use;
    every runner shares the first one's weights and cache (plans of a model share their layout)."""

    name = "interpret"

    def __init__(self, cfg: ModelConfig, weights, batch: int, max_len: int, device, dtype,
                 options: CompileOptions, order: str = "queue", seed: int = 0):
        self.cfg, self.weights, self.batch, self.max_len = cfg, weights, batch, max_len
        self.device, self.dtype, self.options, self.order = device, dtype, options, order
        self.rng = random.Random(seed)
        self.plans: dict[StepShape, Plan] = {}
        self.runners: dict[StepShape, object] = {}
        self.compile_s = 0.0
        self.helper = None  # helper_card.setup.Helper: routed experts partly on a helper
        self.helper_steps: list[dict] = []

    def set_helper(self, helper) -> None:
        if self.runners:
            raise RuntimeError("attach the helper before the first plan is built")
        self.helper = helper

    def shape(self, T: int) -> StepShape:
        return StepShape(T=T, B=self.batch, max_len=self.max_len)

    def _with_helper(self, shape: StepShape) -> StepShape:
        slots = self.helper.capacity if self.helper is not None else -1
        return shape if shape.helper_slots == slots else dataclasses.replace(shape, helper_slots=slots)

    def step_done(self, decode: bool) -> None:
        """A step boundary: helper metrics and expert migration (the next step sees the flips)."""
        if self.helper is not None:
            self.helper_steps.append(self.helper.end_step(decode))

    def plan(self, shape: StepShape | int) -> Plan:
        shape = self._with_helper(self.shape(shape) if isinstance(shape, int) else shape)
        if shape not in self.plans:
            t0 = time.perf_counter()
            self.plans[shape] = compile_step(self.cfg, shape, self.options)
            self.compile_s += time.perf_counter() - t0
        return self.plans[shape]

    def precompile(self, shapes, processes: int) -> None:
        """The plans of `shapes` not compiled yet, compiled by up to `processes` worker processes at once:
        a compile is pure Python, mostly the plan's verification (~25 s for one of dsv2-lite's speculative
        plans on a CPU), so a sweep's plans compile side by side.  They equal what plan() compiles."""
        todo = list(dict.fromkeys(self._with_helper(self.shape(s) if isinstance(s, int) else s) for s in shapes))
        todo = [s for s in todo if s not in self.plans]
        if processes <= 1 or len(todo) <= 1:
            for s in todo:
                self.plan(s)
            return
        t0 = time.perf_counter()
        spawn = multiprocessing.get_context("spawn")  # the parent may hold CUDA and threads: never fork it
        with concurrent.futures.ProcessPoolExecutor(min(processes, len(todo)), mp_context=spawn) as pool:
            n = len(todo)
            for shape, plan in zip(todo, pool.map(compile_step, [self.cfg] * n, todo, [self.options] * n)):
                self.plans[shape] = plan
        self.compile_s += time.perf_counter() - t0

    def runner(self, shape: StepShape | int):
        shape = self._with_helper(self.shape(shape) if isinstance(shape, int) else shape)
        if shape not in self.runners:
            share = next(iter(self.runners.values())).mem if self.runners else None
            self.runners[shape] = self.build(self.plan(shape), None if share else self.weights, share)
            if self.helper is not None:
                self.helper.attach(self.runners[shape])
        return self.runners[shape]

    def build(self, plan: Plan, weights, share):
        return Interpreter(plan, weights, self.device, self.dtype, share=share)

    def warm(self, shapes: list[int]) -> None:
        """Compile (and, for the megakernel, capture) every T that will run, before timing."""
        for T in shapes:
            self.runner(T)

    def run(self, tokens: torch.Tensor, lens: torch.Tensor) -> StepLogits:
        out = self.runner(tokens.shape[1]).step(tokens, lens, order=self.order, rng=self.rng)
        self.step_done(decode=tokens.shape[1] == 1)
        return StepLogits(out.logits, out.hidden)

    def cache_data(self) -> torch.Tensor:
        return next(iter(self.runners.values())).cache()


class MegakernelBackend(InterpreterBackend):
    """The same plans run by the persistent kernel, one CUDA graph per shape (captured on first use)."""

    name = "megakernel"

    def build(self, plan: Plan, weights, share):
        from .runtime import LaunchConfig, Megakernel
        config = LaunchConfig(helper_timeout_s=self.helper.opts.timeout_s) if self.helper is not None else None
        mk = Megakernel(plan, weights, self.device, self.dtype, share=share, config=config)
        if self.device.type == "cuda":
            mk.capture()
        return mk

    def run(self, tokens: torch.Tensor, lens: torch.Tensor) -> StepLogits:
        out = self.runner(tokens.shape[1]).step(tokens, lens)
        self.step_done(decode=tokens.shape[1] == 1)
        return StepLogits(out.logits, out.hidden)


BACKENDS = {"interpret": InterpreterBackend, "megakernel": MegakernelBackend}


@dataclass
class CheckStats:
    """The engine's logits against the reference's, fed the same tokens (teacher forcing)."""

    tolerance: float
    max_rel_err: float = 0.0
    tokens_compared: int = 0
    tokens_equal: int = 0
    mismatches_outside_ties: int = 0

    @property
    def ok(self) -> bool:
        return self.max_rel_err <= self.tolerance and self.mismatches_outside_ties == 0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        g, w = got.double(), want.double()
        self.max_rel_err = max(self.max_rel_err, float((g - w).norm() / w.norm().clamp_min(1e-30)))
        top2 = w.topk(2, dim=-1).values
        near_tie = (top2[..., 0] - top2[..., 1]) <= self.tolerance * w.abs().amax(-1).clamp_min(1.0)
        equal = g.argmax(-1) == w.argmax(-1)
        self.tokens_compared += equal.numel()
        self.tokens_equal += int(equal.sum())
        self.mismatches_outside_ties += int((~equal & ~near_tie).sum())

    def to_dict(self) -> dict:
        return {"max_rel_err": self.max_rel_err, "tolerance": self.tolerance, "tokens_compared": self.tokens_compared,
                "tokens_match": self.tokens_equal == self.tokens_compared, "tokens_equal": self.tokens_equal,
                "mismatches_outside_near_ties": self.mismatches_outside_ties, "ok": self.ok}


@dataclass
class Engine:
    cfg: ModelConfig
    backend: object
    batch: int
    max_len: int
    device: torch.device
    max_chunk: int = 8  # prefill runs in steps of at most this many tokens
    checker: ReferenceBackend | None = None
    check: CheckStats | None = None
    step_seconds: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.lens = torch.zeros(self.batch, dtype=torch.long, device=self.device)

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        if int(self.lens.max()) + tokens.shape[1] > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; this step would need "
                             f"{int(self.lens.max()) + tokens.shape[1]}")
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:  # the step's stream only: background expert copies are not part of a step
            stream.synchronize()
        t0 = time.perf_counter()
        out = self.backend.run(tokens, self.lens)
        if stream is not None:
            stream.synchronize()
        self.step_seconds.append(time.perf_counter() - t0)
        if self.checker is not None:
            self.check.add(out.logits, self.checker.run(tokens, self.lens).logits)
        self.lens = self.lens + tokens.shape[1]
        return out.logits

    def chunks(self, prompt_len: int) -> list[int]:
        """The step sizes T that prefilling a prompt and decoding after it will use."""
        return sorted({min(self.max_chunk, prompt_len - s) for s in range(0, prompt_len, self.max_chunk)} | {1})

    def warm(self, prompt_len: int) -> float:
        """Compile/capture everything the run needs; returns the seconds it took."""
        t0 = time.perf_counter()
        if hasattr(self.backend, "warm"):
            self.backend.warm(self.chunks(prompt_len))
        return time.perf_counter() - t0

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts [B, S] -> logits of the last position [B, V]."""
        logits = None
        for start in range(0, prompts.shape[1], self.max_chunk):
            logits = self._step(prompts[:, start:start + self.max_chunk])
        return logits[:, -1]

    def generate(self, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
        """Greedy: returns (tokens [B, new_tokens], prefill seconds)."""
        t0 = time.perf_counter()
        last = self.prefill(prompts)
        prefill_s = time.perf_counter() - t0
        self.step_seconds.clear()
        out = [last.argmax(-1, keepdim=True)]
        for _ in range(new_tokens - 1):
            out.append(self._step(out[-1])[:, -1].argmax(-1, keepdim=True))
        return torch.cat(out, dim=1), prefill_s


def make_engine(cfg: ModelConfig, weights, backend: str, batch: int, max_len: int, device, dtype,
                workers: int = 8, check: bool = False, order: str = "queue", seed: int = 0,
                options: CompileOptions | None = None, helper=None) -> Engine:
    """helper: a helper_card.setup.HelperOptions (experts partly on a helper), or None."""
    device = torch.device(device)
    if backend == "reference":
        if helper is not None and helper.enabled:
            raise ValueError("--helper needs a compiled backend (interpret or megakernel), not the reference")
        impl = ReferenceBackend(cfg, weights, batch, max_len, device, dtype)
    elif backend in BACKENDS:
        impl = BACKENDS[backend](cfg, weights, batch, max_len, device, dtype,
                                 options or CompileOptions(workers=workers), order, seed)
        if helper is not None and helper.enabled:
            from helper_card.setup import make_helper
            impl.set_helper(make_helper(backend, cfg, weights, helper, device, dtype))
    else:
        raise ValueError(f"unknown backend {backend!r} (reference, interpret, megakernel)")
    engine = Engine(cfg, impl, batch, max_len, device)
    if check:
        # the plain model on the same weights, computed in fp32 where it fits: a bf16 reference
        # rounds activations after every op and is itself ~3e-2 from the truth on llama-1b
        size = sum(t.numel() for t in weights.values())
        roomy = device.type != "cuda" or 4 * size < 0.6 * torch.cuda.mem_get_info(device)[0]
        ref_dtype = torch.float32 if roomy else dtype
        ref_weights = weights if ref_dtype == dtype else {k: v.float() for k, v in weights.items()}
        engine.checker = ReferenceBackend(cfg, ref_weights, batch, max_len, device, ref_dtype)
        engine.check = CheckStats(tolerance=1e-4 if dtype == torch.float32 else (2e-2 if roomy else 5e-2))
    return engine
