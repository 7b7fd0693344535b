"""Weights: seeded random init, safetensors save/load with HF key names, validation.

Weights are a plain ``dict[str, Tensor]`` keyed by HF names.  Each tensor's
random values depend only on (seed, name, device type), so any subset can be
materialised alone (tests build the first layers of a large preset without
the rest).  Loading memory-maps the safetensors files: a tensor's bytes stay
in the page cache until they are copied to their device, so a large
checkpoint never sits twice in host memory.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .schema import TensorSpec, tensor_specs

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names every offending tensor or file."""


# ---------------------------------------------------------------- init
def _std(spec: TensorSpec, cfg: ModelConfig) -> float:
    fan_in = spec.shape[-1]
    if spec.init == "out_proj":
        # keep the residual stream O(1): each of the 2·layers sublayers adds variance ~1/(2·layers)
        return 1.0 / math.sqrt(fan_in * 2 * cfg.num_layers_total)
    if spec.init == "hc_fn":
        return 0.5 / math.sqrt(fan_in)
    return 1.0 / math.sqrt(fan_in)


def init_tensor(spec: TensorSpec, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """One tensor's seeded random values; independent of every other tensor."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % (2**63))
    dtype = dtype if (dtype is not None and spec.dtype != torch.float32) else spec.dtype

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(spec.shape, generator=gen, device=device, dtype=torch.float32) * (hi - lo) + lo

    if spec.init == "embedding":
        # a tied table is also the head: scale it like one, so logits stay O(1) and the
        # input token does not dominate its own prediction
        t = normal(1.0 / math.sqrt(spec.shape[-1]) if cfg.tie_word_embeddings else 1.0)
    elif spec.init == "norm":
        t = uniform(0.8, 1.2)  # not all ones: a skipped norm weight must change the result
    elif spec.init == "bias":
        t = normal(0.05)  # correction bias: small, so it re-ranks near ties only
    elif spec.init == "hc_base":
        t = normal(0.5)
    elif spec.init == "hc_scale":
        t = uniform(0.5, 1.5)
    else:
        t = normal(_std(spec, cfg))
    return t.to(dtype)


def init_weights(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, names: Iterable[str] | None = None,
                 host: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Seeded random weights (optional tensors such as MTP copies of the embedding are left out).

    dtype overrides the config's dtype for every tensor that is not fp32 by definition.  Tensors
    whose name `host` accepts are drawn on `device` (the same values) and moved to host memory
    at once, so the device never holds more than one of them.
    """
    wanted = None if names is None else set(names)
    out = {}
    for spec in tensor_specs(cfg):
        if spec.optional or (wanted is not None and spec.name not in wanted):
            continue
        t = init_tensor(spec, cfg, seed, device, dtype)
        out[spec.name] = t.cpu() if host is not None and host(spec.name) else t
    return out


# ---------------------------------------------------------------- save
def save_checkpoint(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """config.json + model.safetensors in HF layout (per-expert keys as DeepSeek's checkpoints have them)."""
    path = Path(path)
    problems = validate_tensors(cfg, {k: (tuple(v.shape), v.dtype) for k, v in weights.items()})
    if problems:
        raise CheckpointError(f"refusing to save {path}: " + "; ".join(problems))
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")  # never leave a half-written file under the real name
    cfg.save(path)


# ---------------------------------------------------------------- validation
def validate_tensors(cfg: ModelConfig, found: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """Every missing, unexpected, mis-shaped or mis-typed tensor, one phrase each."""
    specs = {s.name: s for s in tensor_specs(cfg)}
    problems = []
    missing = [n for n, s in specs.items() if n not in found and not s.optional]
    if missing:
        problems.append(f"missing tensor(s): {_names(missing)}")
    unexpected = [n for n in found if n not in specs]
    if unexpected:
        problems.append(f"unexpected tensor(s): {_names(unexpected)}")
    for name, (shape, dtype) in found.items():
        spec = specs.get(name)
        if spec is None:
            continue
        if tuple(shape) != spec.shape:
            problems.append(f"tensor {name} has shape {tuple(shape)}, expected {spec.shape}")
        if dtype != spec.dtype:
            problems.append(f"tensor {name} has dtype {_dtype_name(dtype)}, expected {_dtype_name(spec.dtype)}")
    return problems


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_safetensors_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, int, int]]:
    """name -> (shape, dtype, begin, end), after checking the file holds every byte its header promises."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{file}: truncated safetensors file (header of {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{file}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    out, data_end = {}, 0
    for name, info in header.items():
        if info.get("dtype") not in _ST_DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * _ST_SIZES[info["dtype"]]:
            raise CheckpointError(f"{file}: tensor {name} has {end - begin} bytes for shape {shape}")
        out[name] = (shape, _ST_DTYPES[info["dtype"]], begin, end)
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(f"{file}: truncated safetensors file (needs {8 + n + data_end} bytes, has {size})")
    return out


# ---------------------------------------------------------------- load
def load_checkpoint(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    check_finite: bool = True,
                    host: Callable[[str], bool] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights from an HF-style directory; raises CheckpointError naming every problem.

    Validation runs on the headers before any tensor is read.  dtype converts
    every non-fp32 tensor (e.g. bf16 checkpoints into an fp32 reference).  Tensors whose name
    `host` accepts stay in host memory (a cpu helper's experts never pass through the device).
    """
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for file in files:
        for name, (shape, dt, _, _) in read_safetensors_header(file).items():
            if name in where:
                raise CheckpointError(f"tensor {name} appears in both {where[name].name} and {file.name}")
            where[name], found[name] = file, (shape, dt)
    problems = validate_tensors(cfg, found)
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json: " + "; ".join(problems))
    device = torch.device(device)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # memory-mapped
            for name in f.keys():
                t = f.get_tensor(name)
                target = dtype if (dtype is not None and t.dtype != torch.float32) else t.dtype
                t = t.to(device=torch.device("cpu") if host is not None and host(name) else device, dtype=target)
                if check_finite and not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"{file}: tensor {name} contains NaN or inf")
                weights[name] = t
    return cfg, weights


def resolve_shared(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill optional tensors (tied head, MTP embedding/head copies) with the tensors they share."""
    w = dict(weights)
    if cfg.tie_word_embeddings:
        w.setdefault("lm_head.weight", w["model.embed_tokens.weight"])
    for i in range(cfg.num_nextn_predict_layers):
        p = f"model.layers.{cfg.num_hidden_layers + i}."
        w.setdefault(p + "embed_tokens.weight", w["model.embed_tokens.weight"])
        w.setdefault(p + "shared_head.head.weight", w["lm_head.weight"])
    return w

