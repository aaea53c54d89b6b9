"""Under ``bf16`` with CUDA, Triton links the CUDA toolkit's libdevice as eager's kernels do, where Inductor does
not (torch 2.11): ``pow`` and ``erf`` compiled are eager's bits."""

import logging
import os
import types

import h3_fused
import h3_fused.toolkit_libdevice as toolkit
import pytest
import torch
from h3_fused.options import FusionOptions
from torch._inductor import async_compile

VARIABLE = toolkit.LIBDEVICE_VARIABLE


@pytest.fixture
def older_torch(monkeypatch, tmp_path):
    """A torch whose Inductor cannot link the toolkit's libdevice, a CUDA build, a toolkit under ``tmp_path``
    with its libdevice, no choice of the user's, and compile workers not running; returns the libdevice."""
    monkeypatch.setattr(toolkit, "inductor_links_toolkit_libdevice", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", str(tmp_path))
    monkeypatch.setenv(VARIABLE, "")  # restored (unset) when the test ends, whatever the backend sets
    monkeypatch.delenv(VARIABLE)
    monkeypatch.setattr(async_compile.AsyncCompile, "process_pool", types.SimpleNamespace(
        cache_info=lambda: types.SimpleNamespace(currsize=0)))
    libdevice = tmp_path / "nvvm" / "libdevice" / "libdevice.10.bc"
    libdevice.parent.mkdir(parents=True)
    libdevice.write_bytes(b"")
    toolkit.link_toolkit_libdevice.cache_clear()
    yield libdevice
    toolkit.link_toolkit_libdevice.cache_clear()


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_the_backend_links_the_toolkits_libdevice_under_bf16_only(older_torch, policy):
    h3_fused.make_config_patches({"dtype_policy": policy})
    assert os.environ.get(VARIABLE) == (str(older_torch) if policy == "bf16" else None)


def test_a_libdevice_the_user_chose_is_kept(older_torch, monkeypatch):
    monkeypatch.setenv(VARIABLE, "/the/users/libdevice.10.bc")
    h3_fused.make_config_patches({"dtype_policy": "bf16"})
    assert os.environ[VARIABLE] == "/the/users/libdevice.10.bc"


def test_without_a_toolkit_it_says_so_once_and_sets_nothing(older_torch, caplog):
    older_torch.unlink()
    with caplog.at_level(logging.WARNING, logger="h3_fused"):
        for _ in range(2):
            h3_fused.make_config_patches({"dtype_policy": "bf16"})
    assert VARIABLE not in os.environ
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "no CUDA toolkit libdevice" in caplog.records[0].getMessage()


def test_running_compile_workers_are_restarted_to_inherit_it(older_torch, monkeypatch):
    stopped = []
    monkeypatch.setattr(async_compile.AsyncCompile, "process_pool", types.SimpleNamespace(
        cache_info=lambda: types.SimpleNamespace(currsize=1)))
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: stopped.append(True))
    h3_fused.make_config_patches({"dtype_policy": "bf16"})
    h3_fused.make_config_patches({"dtype_policy": "bf16"})
    assert stopped == [True]


def test_a_torch_whose_inductor_links_it_is_left_to_do_so(older_torch, monkeypatch):
    monkeypatch.setattr(toolkit, "inductor_links_toolkit_libdevice", lambda: True)
    h3_fused.make_config_patches({"dtype_policy": "bf16"})
    assert VARIABLE not in os.environ


def test_the_cache_key_tells_the_libdevice(monkeypatch):
    """A graph compiled with one libdevice is not loaded from Inductor's cache for another."""
    fusion = FusionOptions.split({"dtype_policy": "bf16"})[0]
    monkeypatch.delenv(VARIABLE, raising=False)
    bundled = h3_fused.H3FusionPass(fusion).uuid()
    monkeypatch.setenv(VARIABLE, "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc")
    assert h3_fused.H3FusionPass(fusion).uuid() != bundled


@pytest.mark.gpu
def test_pow_and_erf_compiled_under_bf16_are_eagers_bits(fresh_compile):
    """torch 2.11 on an H100 with Triton's bundled libdevice: 66% of these ``pow`` results, 92% of ``erf``'s."""
    if toolkit.toolkit_libdevice() is None and not toolkit.inductor_links_toolkit_libdevice():
        pytest.skip("no CUDA toolkit libdevice on this machine")
    x = torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128
    fn = lambda x: (10000.0 ** x, (x * 7.3) ** 1.7, torch.erf(x * 4 - 2))  # noqa: E731
    got = torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(x)
    assert all(torch.equal(a, b) for a, b in zip(got, fn(x), strict=True))
