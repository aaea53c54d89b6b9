import logging
import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

# Keep CPU runs reproducible and inside the 2-core CI budget.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def pytest_collection_modifyitems(config, items):
    """GPU tests need a CUDA device; interpreted tests need ``TRITON_INTERPRET=1`` and a session of their own
    (the variable makes every op on CPU tensors launch the interpreted kernel). The ``slow`` tests run first, so
    that pytest-xdist hands the longest ones out before the short ones and the workers finish together."""
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: collection order otherwise
    skips = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA device",
        "interpreted": None if INTERPRETING else "needs TRITON_INTERPRET=1 (TRITON_INTERPRET=1 pytest -m interpreted)",
    }
    for item in items:
        marked = [m for m in skips if m in item.keywords]
        if INTERPRETING and "interpreted" not in marked:
            item.add_marker(pytest.mark.skip(reason="runs without TRITON_INTERPRET=1"))
        for mark in marked:
            if skips[mark]:
                item.add_marker(pytest.mark.skip(reason=skips[mark]))


@pytest.fixture(scope="session", autouse=True)
def probed_inductor_numerics(request):
    """Probe once, before any test compiles, whether Inductor reproduces eager on the CPU here (helpers.py).
    Not for a session without a test that compiles for the CPU (GPU or interpreted tests only): the probe
    compiles C++, which costs a minute on a fresh machine."""
    if all({"gpu", "interpreted"} & set(item.keywords) for item in request.session.items):
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


@pytest.fixture
def h3_fused_log():
    """The records of the ``h3_fused`` logger at DEBUG while the test runs."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("h3_fused")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)
