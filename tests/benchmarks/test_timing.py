"""``benchmarks/timing.py``'s sorting of CUDA kernels by what launched them."""

from __future__ import annotations

import types

import pytest
from timing import device_us_by_kind, kernel_kind


@pytest.mark.parametrize("name, kind", [
    ("modulation_kernel", "h3_fused"), ("modulation_backward_kernel", "h3_fused"),
    ("reduce_partials_kernel", "h3_fused"), ("triton_per_fused_add_mul_0", "inductor"),
    ("triton_poi_fused__to_copy_1", "inductor"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >", "other")])
def test_each_kernel_has_the_kind_of_what_launched_it(name, kind):
    assert kernel_kind(name) == kind


def test_device_time_is_summed_by_kind_and_in_total():
    events = [types.SimpleNamespace(name=n, device_time=t) for n, t in
              (("modulation_kernel", 10.0), ("triton_poi_fused_0", 5.0), ("modulation_kernel", 2.5), ("memcpy", 1.0))]
    assert device_us_by_kind(events) == dict(h3_fused=12.5, inductor=5.0, matmul=0.0, attention=0.0, other=1.0,
                                             total=18.5)
