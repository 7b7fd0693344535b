"""Speculative decoding: every step verifies k+1 tokens, accepts on the device and drafts k more.

One step is one plan (graph/lower.py `speculate`): the main model over [last token, d_1..d_k],
ACCEPT (greedy: the longest prefix of drafts the model agrees with, plus its own next token),
then the MTP head drafting k tokens from the accepted position.  The plan's next tokens and
cache lengths feed the next step; the host only reads what was emitted.

Prefill runs the prompt through the same kind of plan with every token accepted ("all"), in
chunks of at most 8, the last chunk k+1 long so drafting starts right at the prompt's end
(a shorter prompt pads the first drafts; padding is just a wrong guess, rejected like one).

Draft sources: `mtp` (the model's MTP layers); `oracle` (what greedy decoding of this engine
emits, so everything is accepted); `noisy:P` (the oracle, each draft wrong with probability P).
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field

import torch

from graph.compile import CompileOptions
from graph.lower import StepShape
from model.config import ModelConfig

from .engine import BACKENDS


@dataclass
class SpecStats:
    k: int
    steps: int = 0
    emitted: int = 0  # tokens kept (after EOS / max_new_tokens cuts)
    accepted_hist: list[int] = field(default_factory=list)  # accepted drafts per (step, live sequence)
    k_hist: list[int] = field(default_factory=list)  # drafts verified, per (step, live sequence)
    step_seconds: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # tokens emitted by decode steps (the first token comes from prefill)
    decode_seconds: float = 0.0  # wall time of the whole decode loop, host work included

    @property
    def acceptance_length(self) -> float:
        """1 + accepted drafts, averaged over live sequence-steps."""
        h = self.accepted_hist
        return 1 + sum(h) / len(h) if h else 0.0

    def per_position(self) -> list[float]:
        """Fraction of sequence-steps whose draft i (1..k) was accepted."""
        h, ks = self.accepted_hist, self.k_hist or [self.k] * len(self.accepted_hist)
        out = []
        for i in range(1, self.k + 1):  # over the sequence-steps that drafted position i
            drafted = [a for a, k in zip(h, ks) if k >= i]
            out.append(sum(a >= i for a in drafted) / len(drafted) if drafted else 0.0)
        return out if h else []

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence keeps per decode step: 1 + accepted drafts, before end-of-run cuts."""
        return self.acceptance_length

    def to_dict(self) -> dict:
        wall = self.decode_seconds
        return {"k": self.k, "steps": self.steps, "tokens": self.emitted,
                "k_mean": sum(self.k_hist) / len(self.k_hist) if self.k_hist else self.k,
                "tokens_per_step": self.tokens_per_step,
                "acceptance_length": self.acceptance_length, "per_position_acceptance": self.per_position(),
                "step_ms_median": (sorted(self.step_seconds)[len(self.step_seconds) // 2] * 1e3
                                   if self.step_seconds else None),
                "tokens_per_s": self.decode_tokens / wall if wall else None}


class Drafts:
    """Where the next step's k drafts come from when not from the model's MTP layers."""

    def __init__(self, kind: str, oracle: list[list[int]] | None = None, vocab: int = 0, seed: int = 0):
        if kind.startswith("noisy:"):
            self.p = float(kind.split(":", 1)[1])
            if not 0 <= self.p <= 1:
                raise ValueError(f"--draft noisy:P needs 0 <= P <= 1, got {self.p}")
        elif kind in ("mtp", "oracle"):
            self.p = 0.0
        else:
            raise ValueError(f"unknown draft source {kind!r} (mtp, oracle, noisy:P)")
        self.kind, self.oracle, self.vocab, self.rng = kind, oracle, vocab, random.Random(seed)

    def fill(self, next_tokens: torch.Tensor, produced: list[list[int]]) -> torch.Tensor:
        """Replace columns 1..k with oracle drafts (corrupted with probability p)."""
        if self.kind == "mtp":
            return next_tokens
        out = next_tokens.clone()
        k = out.shape[1] - 1
        for b, seq in enumerate(produced):
            truth = self.oracle[b]
            for i in range(k):
                # draft i+1 guesses the token after the bonus token (position len(seq) + i)
                j = len(seq) + i
                guess = truth[j] if j < len(truth) else 0
                if self.rng.random() < self.p:
                    guess = (guess + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                out[b, i + 1] = guess
        return out


def prefill_chunks(S: int, k: int, max_chunk: int) -> list[int]:
    """A prompt of S tokens as prefill steps: chunks of up to max_chunk, then its last min(S, k + 1) tokens (the
    step whose accept drafts the first k)."""
    last = min(S, k + 1)
    rest, chunks = S - last, []
    while rest > 0:
        chunks.append(min(max_chunk, rest))
        rest -= chunks[-1]
    return chunks + [last]


def cache_positions(prompt_len: int, new_tokens: int, k: int, max_chunk: int = 8) -> int:
    """Cache positions a run of the speculative decoder needs: the prompt, the new tokens and two steps' drafting
    room, and what the lowering asks of its longest step (a prefill chunk, or k + 1 verified once a decode step
    runs: StepShape.min_max_len, 3·T)."""
    longest = max(prefill_chunks(prompt_len, k, max_chunk) + [k + 1] * (new_tokens > 1))
    return max(prompt_len + new_tokens + 2 * (k + 1), StepShape(T=longest, speculative=True).min_max_len)


class SpeculativeDecoder:
    def __init__(self, cfg: ModelConfig, weights, k: int, batch: int, max_len: int, device="cpu",
                 dtype: torch.dtype | None = None, backend: str = "interpret", workers: int = 8,
                 options: CompileOptions | None = None, max_chunk: int = 8, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, helper=None, adaptive=None):
        """temperature 0: greedy; > 0: speculative sampling (lossless: the target distribution).
        helper: a helper_card.setup.HelperOptions (routed experts partly on a helper), or None.
        adaptive: a megakernel.adaptive.AdaptiveK choosing each step's k in 0..k, or None (always k)."""
        if not 0 <= k <= 7:
            raise ValueError(f"--spec-k must be within 0..7, got {k}")
        self.accept = "sample" if temperature > 0 else "greedy"
        self.temperature, self.top_p = temperature or 1.0, top_p
        self.seeds = torch.Generator().manual_seed(seed)
        if backend not in BACKENDS:
            raise ValueError(f"speculative decoding runs on the interpret or megakernel backend, not {backend!r}")
        self.cfg, self.k, self.batch, self.max_len, self.max_chunk = cfg, k, batch, max_len, max_chunk
        if adaptive is not None and adaptive.kmax != k:
            raise ValueError(f"adaptive k chooses within 0..{adaptive.kmax}, the decoder was built for k={k}")
        self.adaptive = adaptive
        self.engine = BACKENDS[backend](cfg, weights, batch, max_len, torch.device(device), dtype,
                                        options or CompileOptions(workers=workers))
        if helper is not None and helper.enabled:
            from helper_card.setup import make_helper
            self.engine.set_helper(make_helper(backend, cfg, weights, helper, device, dtype))

    def with_k(self, k: int) -> SpeculativeDecoder:
        """This decoder drafting k <= self.k tokens per step: the same engine (plans, graphs, weights, cache)."""
        if not 0 <= k <= self.k:
            raise ValueError(f"k={k} is outside the decoder's 0..{self.k}")
        other = copy.copy(self)
        other.k, other.adaptive = k, None
        return other

    def step_shape(self, T: int, prefill: bool) -> StepShape:
        return StepShape(T=T, B=self.batch, max_len=self.max_len, speculative=True, accept=self.accept,
                         prefill=prefill, temperature=self.temperature, top_p=self.top_p)

    def runner(self, T: int, prefill: bool):
        return self.engine.runner(self.step_shape(T, prefill))

    def precompile(self, ks, prompt_len: int, processes: int) -> None:
        """Every plan that generating from a prompt of prompt_len tokens with each k of `ks` uses (verify
        steps of k+1 tokens, prefill chunks), compiled side by side in `processes` processes."""
        shapes = []
        for k in ks:
            shapes.append(self.step_shape(k + 1, False))
            shapes += [self.step_shape(T, True) for T in self.with_k(k).prefill_chunks(prompt_len)]
        self.engine.precompile(shapes, processes)

    def prefill_chunks(self, S: int) -> list[int]:
        return prefill_chunks(S, self.k, self.max_chunk)

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, drafts: Drafts | None = None,
                 eos: int | None = None) -> tuple[list[list[int]], SpecStats]:
        B, S = prompts.shape
        if B != self.batch:
            raise ValueError(f"prompts have {B} sequences, the decoder was built for {self.batch}")
        need = cache_positions(S, max_new_tokens, self.k, self.max_chunk)
        if need > self.max_len:
            raise ValueError(f"prompt {S} + {max_new_tokens} new tokens at k={self.k} need {need} positions (drafting "
                             f"room, 3x the longest step's tokens), which exceeds the cache of {self.max_len}")
        drafts = drafts or Drafts("mtp")
        if drafts.kind == "mtp" and self.k and not self.cfg.num_nextn_predict_layers:
            raise ValueError("--draft mtp needs a model with MTP layers; use --draft oracle or noisy:P")
        stats = SpecStats(self.k)
        lens = torch.zeros(B, dtype=torch.long)
        start = 0
        out = None
        chunks = self.prefill_chunks(S)
        for n, c in enumerate(chunks):
            chunk = prompts[:, start:start + c]
            follow = prompts[:, start + c] if n + 1 < len(chunks) else torch.full((B,), -1)
            out = self.runner(c, True).step(chunk, lens, follow=follow, seeds=self.step_seeds())
            self.engine.step_done(decode=False)
            lens = out.next_lens.cpu()
            start += c
        produced = [[int(out.next_tokens[b, 0])] for b in range(B)]
        done = [max_new_tokens <= 1 or (eos is not None and produced[b][0] == eos) for b in range(B)]
        next_tokens = out.next_tokens.cpu()
        first = sum(len(p) for p in produced)
        loop_start = time.perf_counter()
        while not all(done):
            t0 = time.perf_counter()
            k = self.adaptive.choose() if self.adaptive else self.k
            # finished sequences run too (one graph for the batch) at frozen lengths: harmless
            tokens = self._next(next_tokens, k, drafts, produced)
            out = self.runner(k + 1, False).step(tokens, lens, seeds=self.step_seeds())
            self.engine.step_done(decode=True)
            stats.step_seconds.append(time.perf_counter() - t0)
            stats.steps += 1
            live = [b for b in range(B) if not done[b]]
            if self.adaptive:
                self.adaptive.observe(k, [int(out.accepted[b]) for b in live])
            for b in live:
                stats.accepted_hist.append(int(out.accepted[b]))
                stats.k_hist.append(k)
                for tok in out.emitted[b].tolist():
                    if tok < 0 or done[b]:
                        break
                    produced[b].append(tok)
                    if len(produced[b]) >= max_new_tokens or (eos is not None and tok == eos):
                        done[b] = True
            # finished sequences stay where they are (re-running the same positions is harmless);
            # letting them advance would run them past the cache
            finished = torch.tensor(done)
            lens = torch.where(finished, lens, out.next_lens.cpu())
            next_tokens = out.next_tokens.cpu()
        stats.decode_seconds = time.perf_counter() - loop_start
        stats.emitted = sum(len(p) for p in produced)
        stats.decode_tokens = stats.emitted - first
        return produced, stats

    def step_seeds(self) -> torch.Tensor | None:
        if self.accept != "sample":
            return None
        return torch.randint(0, 2**31 - 1, (self.batch,), generator=self.seeds)

    def _next(self, next_tokens: torch.Tensor, k: int, drafts: Drafts, produced) -> torch.Tensor:
        """The next step's inputs: the bonus token and k drafts (a short prefill, or a step that drafted
        fewer than k, leaves padding; a step that drafted more is cut to k)."""
        next_tokens = next_tokens[:, :k + 1]
        if next_tokens.shape[1] < k + 1:
            pad = torch.zeros(next_tokens.shape[0], k + 1 - next_tokens.shape[1], dtype=next_tokens.dtype)
            next_tokens = torch.cat((next_tokens, pad), dim=1)
        return drafts.fill(next_tokens, produced)
