import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

# Keep CPU runs reproducible and inside the 2-core CI budget.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run `pytest -m gpu` on the GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def probed_inductor_numerics(request):
    """Probe once, before any test compiles, whether Inductor reproduces eager on the CPU here (helpers.py).
    Not for a session of GPU tests only (``pytest -m gpu``), which never ask: the probe compiles C++ and
    took 74-78 s of the GPU suite on the H200 box (runs 56, 57)."""
    if all("gpu" in item.keywords for item in request.session.items):
        return None
    from helpers import inductor_matches_eager_on_cpu

    matches = inductor_matches_eager_on_cpu()
    if not matches:
        warnings.warn(f"torch {torch.__version__}: Inductor does not reproduce eager's bf16 roundings on the "
                      "CPU; whole-graph bf16 outputs are held to the fp32 policy's bound (README, supported "
                      "versions)", stacklevel=1)
    return matches


@pytest.fixture
def fresh_compile():
    """No compiled code, counters or FX-graph-cache hits carried over from another test."""
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
