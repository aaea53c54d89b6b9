"""The private torch and Triton calls of the eager fast path (``kernels/private_api.py``), held to what they must
answer on each torch version range: a call that moves or changes its meaning fails here, by name, and the fast
path then turns itself off (every call dispatched) rather than run on a guess."""

import pytest
import torch
from h3_fused.kernels import private_api
from torch.torch_version import TorchVersion
from torch.utils._python_dispatch import TorchDispatchMode

IN_TESTED_RANGE = TorchVersion(private_api.TESTED_TORCH[0]) <= torch.__version__ < TorchVersion(
    private_api.TESTED_TORCH[1])


@pytest.mark.skipif(not IN_TESTED_RANGE, reason=f"torch {torch.__version__} is outside {private_api.TESTED_TORCH}")
@pytest.mark.parametrize("name", private_api.WATCHING + (private_api.CUDA if torch.version.cuda else ()))
def test_every_private_call_is_where_the_fast_path_reads_it(name):
    """torch 2.11 up to 2.15: each call exists, and the fast path is on."""
    assert private_api.CALLS[name] is not None, f"{name} has moved on torch {torch.__version__}"
    assert private_api.FAST_PATH


@pytest.mark.skipif(not IN_TESTED_RANGE, reason=f"torch {torch.__version__} is outside {private_api.TESTED_TORCH}")
def test_the_watching_calls_answer_what_the_fast_path_asks():
    """torch 2.11 up to 2.15: nothing watches a plain call; a dispatch mode, a function mode, a functorch transform,
    a TorchScript trace and the autograd profiler are each seen."""
    assert private_api.nothing_watching()
    seen = {}
    with TorchDispatchMode():
        seen["dispatch mode"] = private_api.nothing_watching()
    with torch.device("cpu"):
        seen["function mode"] = private_api.nothing_watching()
    torch.func.vmap(lambda x: seen.setdefault("vmap", private_api.nothing_watching()) or x)(torch.ones(2))
    torch.jit.trace(lambda x: (seen.setdefault("trace", private_api.nothing_watching()), x + 1)[1], torch.ones(1),
                    check_trace=False)
    with torch.autograd.profiler.profile():
        seen["profiler"] = private_api.nothing_watching()
    assert seen == dict.fromkeys(seen, False) and len(seen) == 5, seen


@pytest.mark.gpu
@pytest.mark.skipif(not IN_TESTED_RANGE, reason=f"torch {torch.__version__} is outside {private_api.TESTED_TORCH}")
def test_the_cuda_calls_answer_the_current_device_and_stream():
    assert private_api.current_cuda_device() == torch.cuda.current_device()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert private_api.current_raw_stream(torch.cuda.current_device()) == stream.cuda_stream


@pytest.mark.skipif(IN_TESTED_RANGE, reason=f"torch {torch.__version__} is inside {private_api.TESTED_TORCH}")
def test_outside_the_tested_range_every_call_is_dispatched():
    """Any other torch: the fast path is off, so no private call is made."""
    assert not private_api.FAST_PATH
    assert not private_api.nothing_watching()
    assert private_api.compiled_launcher(object()) is None
