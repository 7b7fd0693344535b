"""The C API (megakernel/capi): a C program decoding through megakernel.h gets the Python engine's tokens, and
each refused call names its problem and leaves the engine as it was."""

import ctypes
import re
import subprocess

import pytest
import torch

from megakernel.capi import build, build_refusal
from megakernel.capi.session import MK_ERR_ARGUMENT, MK_ERR_CAPACITY, CapacityError, Session
from megakernel.engine import make_engine
from megakernel.run import default_dtype, defaults, load_weights, resolve_config

PROMPT = [5, 17, 300, 2, 41, 9, 77, 123, 250, 3, 64]  # 11 tokens: prefill chunks of 8 and 3


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    why = build_refusal()
    if why:
        pytest.skip(why)
    return build(tmp_path_factory.mktemp("capi"))[1]


def run_example(example, *args):
    return subprocess.run([str(example), *map(str, args)], capture_output=True, text=True, timeout=300)


def python_tokens(model, prompt, steps, device="cpu", seed=0):
    """What the Python engine decodes with mk_options' defaults for `device` (interpret in fp32 on a CPU; the
    megakernel in the model's dtype on one SM per worker on CUDA)."""
    cfg, path = resolve_config(model)
    device = torch.device(device)
    _, backend, workers = defaults(device)
    dtype = default_dtype(cfg, device)
    cfg, weights, _ = load_weights(cfg, path, seed, device, dtype)
    engine = make_engine(cfg, weights, backend, 1, 64, device, dtype, workers=workers, seed=seed)
    tokens, _ = engine.generate(torch.tensor([prompt], device=device), steps)
    return tokens[0].tolist()


def decoded(example, model, device):
    done = run_example(example, model, device, 64, 6, *PROMPT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    got = [int(t) for t in next(x for x in lines if x.startswith("tokens:")).split()[1:]]
    vocab, argmax, fed = map(int, re.fullmatch(r"vocab (\d+), argmax of the prompt's logits (\d+) \(mk_feed: (\d+)\)",
                                               lines[0]).groups())
    assert vocab == 512 and argmax == fed == got[0]
    assert f"position {len(PROMPT) + 5}" in lines
    assert f"after reset: position {len(PROMPT)}, next {got[0]}" in lines  # the old positions are not read
    return got


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-dense"])
def test_c_program_decodes_the_python_engines_tokens(example, model):
    assert decoded(example, model, "cpu") == python_tokens(model, PROMPT, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_c_program_runs_the_megakernel(example):
    """On CUDA the library's defaults are the megakernel's, one CUDA-graph replay a step: the same tokens."""
    assert decoded(example, "tiny-moe", "cuda") == python_tokens("tiny-moe", PROMPT, 6, "cuda")


@pytest.mark.parametrize("args, status, words", [
    (("no-such-model", "cpu", 64, 2, 1), MK_ERR_ARGUMENT, ["no-such-model", "neither a preset"]),
    (("tiny-moe", "cpu", 4, 2, 1, 2, 3, 4, 5), MK_ERR_CAPACITY, ["5 token(s) at position 0", "holds 4", "max_len"]),
    (("tiny-moe", "cpu", 64, 2, 1, 99999), MK_ERR_ARGUMENT, ["token 99999", "vocabulary [0, 512)"]),
    (("tiny-moe", "cpu", 0, 2, 1), MK_ERR_ARGUMENT, ["max_len 0"]),
    (("tiny-moe", "gpu9", 64, 2, 1), MK_ERR_ARGUMENT, ["gpu9"]),
])
def test_c_program_gets_a_status_and_a_message(example, args, status, words):
    done = run_example(example, *args)
    assert done.returncode == status + 10, (done.stdout, done.stderr)  # example.c: 10 + the failed call's status
    assert f"(status {status})" in done.stderr
    for w in words:
        assert w in done.stderr


def test_refused_calls_leave_the_session_as_it_was():
    s = Session(model="tiny-moe", device="cpu", max_len=12)
    first = s.feed(PROMPT[:10])
    logits = s.logits.clone()
    with pytest.raises(CapacityError, match="need 13 cache positions; the engine holds 12"):
        s.feed([1, 2, 3])
    with pytest.raises(ValueError, match="token -1 is outside the vocabulary"):
        s.feed([-1])
    with pytest.raises(ValueError, match="no tokens"):
        s.feed([])
    assert s.position == int(s.engine.lens[0]) == 10 and torch.equal(s.logits, logits)
    s.feed([first])
    s.reset()
    assert s.position == int(s.engine.lens[0]) == 0 and s.logits is None
    assert s.feed(PROMPT[:10]) == first  # the cache's old positions are overwritten, not read
    buf = torch.zeros(s.vocab_size - 1)
    with pytest.raises(ValueError, match="holds 511 floats; the vocabulary has 512"):
        s.copy_logits(buf.data_ptr(), buf.numel())


def session_tokens(session, prompt, steps):
    tokens = [session.feed(prompt)]
    while len(tokens) < steps:
        tokens.append(session.feed(tokens[-1:]))
    return tokens


def test_sampling_draws_by_seed_and_position():
    greedy = session_tokens(Session(model="tiny-moe", device="cpu", max_len=64), PROMPT, 8)
    s = Session(model="tiny-moe", device="cpu", max_len=64, sample_seed=3, temperature=1.5)
    sampled = session_tokens(s, PROMPT, 8)
    assert sampled != greedy
    s.reset()
    assert session_tokens(s, PROMPT, 8) == sampled  # a conversation fed again draws the same tokens
    other = Session(model="tiny-moe", device="cpu", max_len=64, sample_seed=4, temperature=1.5)
    assert session_tokens(other, PROMPT, 8) != sampled
    # a top-p mass below any one token's keeps only the most likely token: greedy decoding
    narrow = Session(model="tiny-moe", device="cpu", max_len=64, sample_seed=3, temperature=1.5, top_p=1e-9)
    assert session_tokens(narrow, PROMPT, 8) == greedy


class Options(ctypes.Structure):
    """megakernel.h's mk_options."""
    _fields_ = [("struct_size", ctypes.c_uint32), ("model", ctypes.c_char_p), ("backend", ctypes.c_char_p),
                ("device", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("max_len", ctypes.c_int32),
                ("workers", ctypes.c_int32), ("seed", ctypes.c_uint64), ("temperature", ctypes.c_float),
                ("top_p", ctypes.c_float), ("sample_seed", ctypes.c_uint64)]


def c_tokens(lib, options, prompt, steps):
    """(status, tokens) of mk_open and mk_feed calls through the library, in this process's Python."""
    engine = ctypes.c_void_p()
    status = lib.mk_open(ctypes.byref(options), ctypes.byref(engine))
    if status:
        return status, lib.mk_last_error().decode()
    tokens, next_token = [], ctypes.c_int32()
    feed = (ctypes.c_int32 * len(prompt))(*prompt)
    for _ in range(steps):
        assert lib.mk_feed(engine, feed, len(feed), ctypes.byref(next_token)) == 0, lib.mk_last_error()
        tokens.append(next_token.value)
        feed = (ctypes.c_int32 * 1)(next_token.value)
    lib.mk_close(engine)
    return 0, tokens


def test_c_options_sample_and_an_older_callers_struct_gets_the_defaults(example):
    lib = ctypes.CDLL(str(example.parent / "libmegakernel.so"))
    lib.mk_last_error.restype = ctypes.c_char_p
    options = Options()
    lib.mk_options_init(ctypes.byref(options))
    assert options.struct_size == ctypes.sizeof(Options) and options.top_p == 1.0 and options.temperature == 0
    options.model, options.device, options.max_len = b"tiny-moe", b"cpu", 64
    options.temperature, options.sample_seed = 1.5, 3
    sampled = Session(model="tiny-moe", device="cpu", max_len=64, sample_seed=3, temperature=1.5)
    assert c_tokens(lib, options, PROMPT, 8) == (0, session_tokens(sampled, PROMPT, 8))
    # the first version's struct ended at seed: the temperature past its size is not read
    options.struct_size = Options.temperature.offset
    greedy = Session(model="tiny-moe", device="cpu", max_len=64)
    assert c_tokens(lib, options, PROMPT, 8) == (0, session_tokens(greedy, PROMPT, 8))
    options.struct_size = Options.seed.offset
    status, message = c_tokens(lib, options, PROMPT, 8)
    assert status == MK_ERR_ARGUMENT and "struct_size" in message
    options.struct_size, options.temperature, options.top_p = ctypes.sizeof(Options), 0.0, 0.5
    status, message = c_tokens(lib, options, PROMPT, 8)
    assert status == MK_ERR_ARGUMENT and "top_p 0.5 needs temperature > 0" in message
    options.temperature = float("nan")
    status, message = c_tokens(lib, options, PROMPT, 8)
    assert status == MK_ERR_ARGUMENT and "temperature must be >= 0 and finite" in message and "got nan" in message
