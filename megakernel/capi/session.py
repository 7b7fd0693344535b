"""The Python side of the C API (megakernel.h): one decode session per `mk_engine` handle.

libmegakernel embeds CPython and calls these functions; each C status code is a class of exception here
(`status_of`).  Every argument is checked before anything runs, so a refused call changes nothing: a prompt that
would overflow the cache is refused whole, not after some of its chunks were written.
"""

from __future__ import annotations

import ctypes

import torch

from model import CheckpointError, ConfigError
from model.schema import DTYPES

from ..engine import make_engine
from ..launch import MegakernelError
from ..ops.spec import sample, target_probs, uniform
from ..run import check_sampling, default_dtype, defaults, load_weights, resolve_config, resolve_device

# the C API's status codes (megakernel.h's mk_status)
MK_OK, MK_ERR_ARGUMENT, MK_ERR_CAPACITY, MK_ERR_RUNTIME, MK_ERR_PYTHON = 0, 1, 2, 3, 4


class CapacityError(ValueError):
    """A call that would need more cache positions than the engine was opened with."""


def status_of(exc: BaseException) -> tuple[int, str]:
    """(status code, message) the C caller gets for an exception raised by a session call."""
    if isinstance(exc, CapacityError):
        code = MK_ERR_CAPACITY
    elif isinstance(exc, (ValueError, TypeError, KeyError, ConfigError, CheckpointError)):
        code = MK_ERR_ARGUMENT
    else:
        code = MK_ERR_RUNTIME
    if isinstance(exc, MegakernelError | RuntimeError | OSError) or code != MK_ERR_RUNTIME:
        return code, str(exc)
    return code, f"{type(exc).__name__}: {exc}"


class Session:
    """A model's engine (batch 1) and the position its cache is filled to.  The next token is the logits' argmax
    (temperature 0) or drawn from softmax(logits / temperature) cut to its top-p mass (ops/spec.target_probs, the
    CLI's sampling) with the uniform ops/spec.uniform(sample_seed, position, 0): a draw depends on that seed and
    the position only, so a conversation fed again after reset draws the same tokens.  `seed` seeds the weights
    of a model without a checkpoint."""

    def __init__(self, model: str = "", backend: str = "", device: str = "", dtype: str = "", max_len: int = 4096,
                 seed: int = 0, workers: int = 0, temperature: float = 0.0, top_p: float = 1.0,
                 sample_seed: int = 0):
        check_sampling(temperature, top_p)
        device = resolve_device(device, "device")
        default_model, default_backend, default_workers = defaults(device)
        name, backend = model or default_model, backend or default_backend
        if dtype and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
        cfg, path = resolve_config(name)
        if not 1 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len}: between 1 and {name}'s max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if workers < 0:
            raise ValueError(f"workers {workers}: >= 1, or 0 for the device's default")
        dtype_ = DTYPES[dtype] if dtype else default_dtype(cfg, device)
        cfg, weights, _ = load_weights(cfg, path, seed, device, dtype_)
        self.engine = make_engine(cfg, weights, backend, 1, max_len, device, dtype_, workers=workers or default_workers,
                                  seed=seed)
        self.engine.warm(1)  # decode's step shape compiled (and captured) before the first call needs it
        self.vocab_size = cfg.vocab_size
        self.sample_seed, self.temperature, self.top_p = sample_seed, temperature, top_p
        self.position = 0  # engine.lens[0], kept on the host: no device read a step to know it
        self.logits: torch.Tensor | None = None  # [V] fp32: the last fed position's

    def _tokens(self, tokens: list[int], what: str) -> torch.Tensor:
        if not tokens:
            raise ValueError(f"{what}: no tokens")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self.position + len(tokens) > self.engine.max_len:
            raise CapacityError(f"{what}: {len(tokens)} token(s) at position {self.position} need "
                                f"{self.position + len(tokens)} cache positions; the engine holds "
                                f"{self.engine.max_len} (mk_options.max_len)")
        return torch.tensor([tokens], dtype=torch.long, device=self.engine.device)

    def feed(self, tokens: list[int]) -> int:
        """Append tokens at the current position (a prompt, or the last chosen token); returns the next token
        after them: greedy, or sampled (the class's note)."""
        last = self.engine.prefill(self._tokens(tokens, "feed"))
        self.position += len(tokens)
        # kept on the device (the runtime's output buffer is the next step's): only the token crosses to the
        # host each step, the vocabulary's logits when mk_logits asks
        self.logits = last[0].to(torch.float32, copy=True)
        if self.temperature == 0:
            return int(self.logits.argmax())
        p = target_probs(self.logits, self.temperature, self.top_p)
        return sample(p, uniform(self.sample_seed, self.position, 0))

    def copy_logits(self, address: int, capacity: int) -> int:
        """The last fed position's logits (fp32) copied to `address`; returns how many were copied."""
        if self.logits is None:
            raise ValueError("logits: nothing fed yet")
        if capacity < self.vocab_size:
            raise ValueError(f"logits: the buffer holds {capacity} floats; the vocabulary has {self.vocab_size}")
        host = self.logits.cpu()
        ctypes.memmove(address, host.data_ptr(), self.vocab_size * 4)
        return self.vocab_size

    def reset(self) -> None:
        """Back to position 0 (a new conversation): positions are overwritten as they are fed again."""
        self.engine.lens.zero_()
        self.position, self.logits = 0, None
