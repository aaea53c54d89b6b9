"""``H3FusionPass``: the Inductor post-grad pass that fuses every modulation site it can prove.

Order: find site-A outputs and site-C outputs, merge each C whose stored residual feeds an A into one
B-shaped site, then replace; under ``bf16``, then put ``h3_fused::eager_rms_norm`` or
``h3_fused::eager_layer_norm`` (eager's bits) where a norm is left outside the sites. Candidates that fail a
check are left untouched and logged with the reason. The pass is a ``CustomGraphPass`` whose ``uuid()`` hashes the pattern, kernel and pass sources
and the options, so the FX graph cache stays on and a change of any of them misses.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time

import h3_fused.kernels as kernels_pkg
import h3_fused.patterns as patterns_pkg
import torch
from h3_fused.patterns import find_sites
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph

from .logs import log, refuse
from .options import FusionOptions
from .replace import replace_norms, replace_sites
from .toolkit_libdevice import LIBDEVICE_VARIABLE


def _sources() -> tuple[str, ...]:
    roots = [pathlib.Path(p.__file__).parent for p in (kernels_pkg, patterns_pkg)]
    roots.append(pathlib.Path(__file__).parent)
    return tuple(sorted(str(f) for root in roots for f in root.glob("*.py")))


# A pass Inductor hands the graph's ``is_inference`` (torch 2.12 on; torch 2.11 has no such pass)
INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


def custom_passes(setting) -> tuple:
    """The passes a custom-pass setting of Inductor's (``post_grad_custom_post_pass``, ``joint_custom_pre_pass``)
    holds: none, one, or (torch 2.13 on) a list or tuple (torch's own ``get_custom_graph_passes``, which torch 2.11
    and 2.12 lack)."""
    if setting is None:
        return ()
    return tuple(setting) if isinstance(setting, (list, tuple)) else (setting,)


def chained_passes(setting, ours: type) -> tuple:
    """The passes of ``setting`` (``custom_passes``) a pass of ours chains, a pass of class ``ours`` standing for the
    passes it chains: compiling through the backend twice chains the user's passes once, not our pass in ours."""
    return tuple(q for p in custom_passes(setting) for q in (p.chained if isinstance(p, ours) else (p,)))


def chained_uuids(passes: tuple) -> tuple | None:
    """The ``uuid()`` of each chained pass, or None where one has none (an opaque user pass: caching would be unsafe,
    and Inductor bypasses the cache for it too)."""
    uuids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in passes)
    return uuids if all(uuids) else None


class H3FusionPass(INFERENCE_AWARE or CustomGraphPass):
    """Fuse the AdaLN modulation sites of a post-grad graph; then run ``chained`` (the passes the user set),
    in order, each called as Inductor would call it (with ``is_inference`` where it is inference-aware)."""

    def __init__(self, options: FusionOptions = FusionOptions(), chained=None, fuse: bool = True,
                 source: str | None = None):
        self.options = options
        self.fusing = fuse  # False: only the chained passes run (the sites were fused before autograd)
        # the code of the Dynamo graph the backend compiles (None through make_config_patches): part of uuid(), so
        # that two Dynamo graphs that lower to one Inductor graph (an FP32LayerNorm of x.float() and an
        # nn.LayerNorm of bf16 x do) keep cache entries of their own, and each one's record of what fused
        # (``cached.py``) stays true on a hit
        self.source = source
        self.chained = chained_passes(chained, H3FusionPass)  # None, one pass, or a list or tuple of them

    def __call__(self, graph: Graph, is_inference: bool | None = None) -> None:
        if self.fusing:
            start = time.perf_counter()
            sites, norms = self.fuse(graph)
            if sites or norms:
                graph.lint()
            log.debug("h3_fused: %d site(s) fused, %d norm(s) outside them as eager computes them, in %.1f ms", sites,
                      norms, 1e3 * (time.perf_counter() - start))
        for chained in self.chained:
            if INFERENCE_AWARE is not None and isinstance(chained, INFERENCE_AWARE):
                chained(graph, is_inference=is_inference)
            else:
                chained(graph)

    def fuse(self, graph: Graph) -> tuple[int, int]:
        """Replace every site of ``graph``, then (``bf16``) the norms outside them; ``(sites, norms)``
        replaced."""
        sites = find_sites(graph, refuse, note=log.debug, row_biases=True)  # inference graphs
        return replace_sites(graph, sites, self.options, decomposed=True), replace_norms(graph, self.options)

    def uuid(self) -> bytes | None:
        chained = chained_uuids(self.chained)
        if chained is None:
            return None
        digest = hashlib.sha256(get_hash_for_files(_sources()))
        # the libdevice Triton links (toolkit_libdevice.py) is not in torch 2.11's cache key: a graph built with
        # another one must miss
        libdevice = os.environ.get(LIBDEVICE_VARIABLE)
        digest.update(repr((self.options, self.fusing, torch.__version__, chained, self.source, libdevice)).encode())
        return digest.digest()
