import os

import torch

# Without a GPU, Triton task bodies run in Triton's interpreter.  It must be on before
# anything imports the kernels (transformers imports triton too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from graph.fusion import DEFAULT_RULES, WEIGHT_RULES  # noqa: E402
from megakernel.launch import INTERPRET  # noqa: E402


def _patch_each_language_once_per_launch() -> None:
    """Triton's interpreter (3.6) re-patches triton.language on every call of a @triton.jit function from
    inside a kernel (interpreter._patch_lang: inspect.getmembers over tl, tl.tensor and tl.math, ~0.5 ms),
    tens of thousands of times in one megakernel step: a third of this suite's interpreter time.  Within
    one launch every such re-patch after the first for the same modules is a no-op: the builtins it looks
    for were already replaced by non-builtin wrappers (is_builtin is then False), and the rest of it sets
    the same attributes to equivalent fresh functions.  So, per launch and per thread, a nested call whose
    language modules a call of this launch already patched skips it; a launch itself (GridExecutor) and
    the first nested call for a module still patch exactly as before, and the launch restores as before.
    The kernels run the same operations on the same values.  MEGAKERNEL_TEST_PLAIN_INTERPRETER=1 turns
    this off; a Triton without these internals is left alone."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("MEGAKERNEL_TEST_PLAIN_INTERPRETER") == "1":
        return
    import inspect
    import triton.language as tl
    from triton.runtime import interpreter
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "GridExecutor", "InterpretedFunction")):
        return
    if "_patch_lang(self.fn)" not in inspect.getsource(interpreter.InterpretedFunction.__call__):
        return
    original_patch, original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()
    languages: dict = {}  # a jit function -> the ids of the language modules among its globals (_patch_lang's)

    def launch(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set()  # this launch's patched language modules
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    def patch_lang(fn):
        patched = getattr(state, "patched", None)
        langs = languages.get(fn)
        if langs is None:
            langs = languages[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                              if inspect.ismodule(v) and v in (tl, tl.core))
        if patched is not None and patched and langs and langs <= patched:
            return None  # a nested call (InterpretedFunction.__call__ drops the scope it returns)
        if patched is not None:
            patched |= langs
        return original_patch(fn)

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


_patch_each_language_once_per_launch()


def _drop_the_unchecked_overflow_arithmetic() -> None:
    """Triton's interpreter (3.6) computes an overflow check for every int32 add, sub and mul of a kernel (its
    InterpreterOptions.sanitize_overflow, on, no knob: an int64 copy, two compares and a device_assert each),
    ~40% of tests/test_triton_interpret.py's time (286 -> 171 s, session 38).  Its options also have debug off,
    which makes that device_assert a no-op, so the check never fires: the arithmetic is dropped unused
    (tests/test_harness.py pins both).  Turning it off leaves the same operations on the same values and no
    check less.  MEGAKERNEL_TEST_PLAIN_INTERPRETER=1 leaves it on; a Triton without these internals is left alone."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("MEGAKERNEL_TEST_PLAIN_INTERPRETER") == "1":
        return
    from triton.runtime import interpreter
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


_drop_the_unchecked_overflow_arithmetic()

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=300,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Each failure's report appended, as it happens, to $MEGAKERNEL_FAILURES_LOG (tools/gpu_session.sh sets it):
    a device call cut by its time limit kills pytest before its summary, and session 38 lost every failure's
    reason that way.  Written by the process that reports (xdist's controller, not its workers: no twins)."""
    path = os.environ.get("MEGAKERNEL_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def stall_is_a_watchdog_error_then_recovers(mk, task: int, tokens, lens) -> None:
    """A captured megakernel's step with `task` waiting on a counter nobody signals raises the watchdog's error
    within a second, and once undone the next step gives the logits of a step before the stall."""
    import time
    import pytest
    from megakernel.runtime import WatchdogError
    good = mk.step(tokens, lens).logits.clone()
    undo = mk.inject_stall(task)
    t0 = time.perf_counter()
    with pytest.raises(WatchdogError, match="timed out"):
        mk.step(tokens, lens)
    assert time.perf_counter() - t0 < 1.0
    undo()
    assert torch.equal(mk.step(tokens, lens).logits, good)


# Block sizes every tiny preset's plans (T <= 8, B <= 3, any attention split) fit within: GPU tests
# build dozens of small plans, and each distinct set of block sizes is another JIT compile of the
# megakernel (~30-40 s on an H200), so they run under megakernel.launch.shared_blocks(TINY_BLOCKS):
# one compile per weight dtype.  tests/test_triton_interpret.py checks both that it covers the plans
# and that the kernel built with it equals the interpreter.
# the default fusion rules without the norm folds: every RMSNorm a task of its own (the A side of
# the fold, and the plain RMSNORM body on every layer)
UNFOLDED = tuple(r for r in DEFAULT_RULES if r not in WEIGHT_RULES)
# (QIX=3, WAITS=2 and PIN=1: MLA plans' defaults, here for GQA too, where a tiny-dense plan alone fits 0, 1 and 0;
# the interpreter runs no PIN)
TINY_BLOCKS = dict(ATT_KIND=0, ATT_ROPE=1, BM=32, DMAX=32, BIT=32, BP=128, BW=32, BSC=16, BCW=32, BK=4, TB=16, QIX=3,
                   WAITS=2, PIN=0 if INTERPRET else 1)


@pytest.fixture
def one_kernel_for_tiny_models(request):
    """GPU tests: tiny presets share one compiled kernel (TINY_BLOCKS); llama-1b and dsv2-lite keep the
    sizes fitted to them, as they are served."""
    from megakernel.launch import shared_blocks
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("name") in ("llama-1b", "dsv2-lite"):
        yield
        return
    with shared_blocks(TINY_BLOCKS):
        yield
