"""Shared helpers of the tests: tiny models, counting fused sites, compiling a function with h3_fused against eager
(the sites' tensors and eager spellings are ``h3_fused.kernels.testing``'s, which the benchmarks share)."""

from __future__ import annotations

import functools
import math

import h3_fused
import torch
import torch.nn.functional as F
from minimax_h3 import H3Config, H3Model, Spellings, example_inputs, init_weights
from torch._dynamo.utils import counters

bf16 = torch.bfloat16


def tiny(seed=0, tokens=64, **cfg_overrides):
    cfg = H3Config.tiny(**cfg_overrides)
    model = init_weights(H3Model(cfg), seed=seed)
    latents, layout = example_inputs(cfg, tokens)
    return model, latents, layout


def sites_fused() -> int:
    """The sites the pass fused since the counters were last cleared (the norms it kept as eager computes them and
    the candidates it refused are counted apart)."""
    from h3_fused.patterns import SiteKind

    return sum(counters["h3_fused"][kind.value] for kind in SiteKind)


def _replacements_in(graph, mark: str) -> int:
    """The replacements of a post-grad graph, by the ``mark`` every node of one carries (its value names it)."""
    return len({n.meta[mark] for n in graph.nodes if mark in n.meta})


def fused_sites_in(graph) -> int:
    """The fused sites of a post-grad graph."""
    from h3_fused.patterns.replacements import SITE_META

    return _replacements_in(graph, SITE_META)


def eager_norms_in(graph) -> int:
    """The RMSNorms of a post-grad graph replaced by ``h3_fused::eager_rms_norm`` (on CUDA the op decomposes
    into its kernel's launch, so its nodes are counted by their mark)."""
    from h3_fused.patterns.replacements import NORM_META

    return _replacements_in(graph, NORM_META)


PUBLIC_SPELLINGS = [  # spec section 2, one switch at a time, then all at once
    Spellings(norm="native"),
    Spellings(gather="getitem"),
    Spellings(one_plus_first=False, gate_first=False),
    Spellings(trailing_to=False),
    Spellings(upcast_tables=True),
    Spellings(fp32_tables=True),
    Spellings(index_dtype=torch.int32),
    Spellings(batched=True),
    Spellings(norm="native", gather="getitem", upcast_tables=True, index_dtype=torch.int32, batched=True,
              one_plus_first=False, gate_first=False),
]


def regional_against_eager(model, latents, layout, policy="bf16"):
    """``(compiled output, eager output, sites fused)`` after regional compile of ``model``."""
    with torch.no_grad():
        expected = model(latents, layout)
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
        got = model(latents, layout)
    return got, expected, sites_fused()


@functools.cache
def inductor_matches_eager_on_cpu() -> bool:
    """Whether this torch's Inductor, with ``emulate_precision_casts``, computes unfused bf16 ops (an
    RMSNorm, gathers, the affine) bit-identically to eager on the CPU: the premise of the tests that
    compare a whole compiled graph with eager (or two compiled graphs with each other) bit for bit. True on
    torch 2.13 and 2.14; on 2.11 and 2.12 the C++ backend drops eager's intermediate bf16 roundings. Probed
    once a process, not read from the version (the session's first test probes it, conftest.py: the probe
    resets Dynamo)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=g).to(torch.bfloat16), torch.randn(64, generator=g).to(torch.bfloat16)
    table, idx = torch.randn(4, 64, generator=g).to(torch.bfloat16), torch.randint(0, 4, (16,), generator=g)

    def unfused(x):
        return F.rms_norm(x, (64,), w, 1e-5) * table[idx] + table[idx]

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(unfused, options={"emulate_precision_casts": True})(x)
    torch._dynamo.reset()
    return torch.equal(compiled, unfused(x))


@functools.cache
def inductor_matches_eager_transcendentals_on_cpu() -> bool:
    """Whether Inductor's C++ code computes fp32 ``exp``, ``sin`` and ``cos`` as eager's kernels do on this CPU:
    a sinusoidal timestep embedding, as a DiT's whole graph computes it (diffusers' ``get_timestep_embedding``).
    Vectorized math differs between CPUs and their vector widths (docs/RELIABILITY.md: an AMD EPYC with AVX-512):
    then no whole model compiled by Inductor is eager's bits there, whatever the pass does, and the whole-model
    tests hold it to the ``fp32`` bound."""

    def embedding(t):
        half = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float32) / 128)
        angles = t[:, None].float() * half[None, :]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    t = torch.tensor([500.0, 700.0, 13.0])
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(embedding, options={"emulate_precision_casts": True})(t)
    torch._dynamo.reset()
    return torch.equal(compiled, embedding(t))


def assert_bf16_policy(got, expected):
    """A whole compiled graph under ``bf16`` against eager, on the CPU, where Inductor compiles the sites'
    eager operations as well as the ops around them: bit-identical where this torch's Inductor reproduces
    eager (``inductor_matches_eager_on_cpu``, for the small graphs of these tests); elsewhere its code
    rounds differently from eager, and the output is held to the ``fp32`` policy's bound."""
    if inductor_matches_eager_on_cpu():
        assert torch.equal(got, expected), "bf16 (and auto on the CPU) must be bit-identical to eager"
    else:
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.02 * expected.abs().max().item())


def assert_sites_fuse_within_policy(case, fn, args, expected_sites: int, all_fused: bool, dynamic: bool = False):
    """The differential tests' check of one drawn ``case`` (its ``policy``): ``fn`` compiled with h3_fused fuses
    ``expected_sites`` sites; where every site fused under ``bf16`` (and this torch's Inductor reproduces eager on
    the CPU) its outputs are Inductor's bits with ``emulate_precision_casts`` (which compiles the sites' eager
    operations); always within a few ulps of eager."""
    from h3_fused.patterns import SiteKind

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        eager = fn(*args)
        got = torch.compile(fn, backend="h3_fused", dynamic=dynamic, options={"dtype_policy": case.policy})(*args)
        fused = sum(counters["h3_fused"][kind.value] for kind in SiteKind)
        exact = case.policy != "fp32" and all_fused and inductor_matches_eager_on_cpu()
        if exact:  # on the CPU Inductor compiles the sites' reference ops (eager's operations)
            torch._dynamo.reset()
            inductor = torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True})(*args)
    assert fused == expected_sites, f"{case}: fused {dict(counters['h3_fused'])}, expected {expected_sites}"
    for k, (e, o) in enumerate(zip(eager, got)):
        if exact:
            assert torch.equal(o, inductor[k]), f"{case}: not Inductor's bits under {case.policy}"
        scale = e.float().abs().max().item() + 1e-3
        torch.testing.assert_close(o.float(), e.float(), rtol=2**-6, atol=2**-5 * scale, msg=str(case))


H, K, T = 64, 6, 16


def inputs():
    """Tensors of a small site (H = 64, K = 6, T = 16): x, branch, weight, three table views, two indices."""
    g = torch.Generator().manual_seed(0)
    tables = (0.3 * torch.randn(K, 6 * H, generator=g)).to(bf16).chunk(6, -1)
    return dict(x=torch.randn(T, H, generator=g).to(bf16), b=torch.randn(T, H, generator=g).to(bf16),
                w=(1 + 0.1 * torch.randn(H, generator=g)).to(bf16), shift=tables[0], scale=tables[1],
                gate=tables[2], idx=torch.randint(0, K, (T,), generator=g),
                idx2=torch.randint(0, K, (T,), generator=g))


def site_a(x, b, w, shift, scale, gate, idx, idx2):
    n = F.rms_norm(x, (H,), w, 1e-5)
    return n * (1 + scale.index_select(0, idx)) + shift.index_select(0, idx)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def fused_count(fn) -> int:
    """Sites fused in ``fn``, after checking what the compiled ``fn`` computes: what eager computes
    under ``bf16``, and when nothing fused, exactly what Inductor computes (the graph was left alone; the norms
    outside the sites are left to Inductor too, ``eager_norms=False``)."""
    t = inputs()
    expected = fn(**t)
    got = torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16", "eager_norms": False})(**t)
    fused = sites_fused()
    for e, g in zip(as_tuple(expected), as_tuple(got)):
        assert_bf16_policy(g, e)
    if fused == 0:
        untouched = torch.compile(fn, options={"emulate_precision_casts": True})(**t)
        assert all(torch.equal(u, g) for u, g in zip(as_tuple(untouched), as_tuple(got)))
    return fused


def gradients(fn, tensors: dict, wrt, seed=1):
    """``{name: grad}`` of a fixed random projection of ``fn``'s outputs, with respect to ``wrt`` (the projection's
    values are bf16 numbers: the incoming gradients are the same in a bf16 and an fp64 graph)."""
    leaves = {k: v.detach().clone().requires_grad_(k in wrt) if isinstance(v, torch.Tensor) else v
              for k, v in tensors.items()}
    outputs = fn(**leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g).to(bf16).to(o.device).double()).sum() for o in outputs)
    loss.backward()
    return {k: leaves[k].grad for k in wrt}


def in_fp64(t: dict) -> dict:
    """The floating-point tensors of ``t`` in fp64."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in t.items()}


SCATTERS = ("index_put", "index_add", "scatter_add")  # how an unfused gather's backward sums table rows


class GraphSpy:
    """A user post-grad pass (chained after ours) that records the call targets of every graph Inductor compiles."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append([str(n.target) for n in graph.nodes if n.op == "call_function"])

    def count(self, name: str) -> int:
        return sum(t.count(name) for g in self.graphs for t in g)

    def scatters(self) -> list[str]:
        return [t for g in self.graphs for t in g if any(s in t for s in SCATTERS)]


def assert_gradients_close(got: dict, expected: dict, rel: float | None = None):
    """Each gradient within ``rel`` of eager's in norm: by default 2%, or 5% where Inductor's C++ code drops
    eager's intermediate bf16 roundings (``inductor_matches_eager_on_cpu``: torch 2.11, 2.12), where plain
    Inductor's gradients stray from eager's about as far."""
    rel = rel if rel is not None else 2e-2 if inductor_matches_eager_on_cpu() else 5e-2
    assert got.keys() == expected.keys()
    for name, g in got.items():
        e = expected[name].float()
        assert (g.float() - e).norm() <= rel * e.norm() + 1e-6, name
