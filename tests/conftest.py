import os

import torch

# Without a GPU, Triton task bodies run in Triton's interpreter.  It must be on before
# anything imports the kernels (transformers imports triton too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from graph.fusion import DEFAULT_RULES, WEIGHT_RULES  # noqa: E402

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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# Block sizes every tiny preset's plans (T <= 8, B <= 3, any attention split) fit within: GPU tests
# build dozens of small plans, and each distinct set of block sizes is another JIT compile of the
# megakernel (~30-40 s on an H200), so they run under megakernel.runtime.shared_blocks(TINY_BLOCKS):
# one compile per weight dtype.  tests/test_triton_interpret.py checks both that it covers the plans
# and that the kernel built with it equals the interpreter.
# the default fusion rules without the norm folds: every RMSNorm a task of its own (the A side of
# the fold, and the plain RMSNORM body on every layer)
UNFOLDED = tuple(r for r in DEFAULT_RULES if r not in WEIGHT_RULES)
TINY_BLOCKS = dict(ATT_KIND=0, BM=32, DMAX=32, BIT=32, BP=128, BW=32, BSC=16, BCW=32, BK=4, TB=16)


@pytest.fixture
def one_kernel_for_tiny_models(request):
    """GPU tests: tiny presets share one compiled kernel (TINY_BLOCKS); llama-1b and dsv2-lite keep the
    sizes fitted to them, as they are served."""
    from megakernel.runtime import shared_blocks
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("name") in ("llama-1b", "dsv2-lite"):
        yield
        return
    with shared_blocks(TINY_BLOCKS):
        yield
