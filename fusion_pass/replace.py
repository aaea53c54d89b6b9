"""Replacing the sites a search found, under the pass's options: counted, logged, each output renamed for the
sites that read it; then, under the ``bf16`` policy, the norms outside the sites as eager computes them."""

from __future__ import annotations

from h3_fused.kernels.policy import resolve_policy
from h3_fused.patterns import NoMatch, Site, find_norms, replace_norm, replace_site
from h3_fused.patterns.graph_view import device_of, source_of
from torch.fx import Graph

from .logs import count, log, refuse
from .options import FusionOptions


def replace_sites(graph: Graph, sites: list[Site], options: FusionOptions, decomposed: bool) -> int:
    """Replace ``sites`` in ``graph`` (``replace_site``'s ``decomposed`` form or op calls); the number replaced."""
    fused = 0
    renamed = {}  # outputs of replaced sites -> the fused op's outputs (inputs of later sites)
    for site in sites:
        site.inputs = {k: renamed.get(v, v) for k, v in site.inputs.items()}
        policy = resolve_policy(options.dtype_policy, device_of(site.lead))
        try:
            new_outputs = replace_site(graph, site, policy, decomposed)
        except NoMatch as why:
            refuse(site.outputs[-1], why, f"site {site.kind.letter}")
            continue
        renamed.update(zip(site.outputs, new_outputs))
        fused += 1
        count(site.kind.value)
        log.debug("h3_fused: fused site %s%s as h3_fused::%s (policy %s)", site.kind.letter, _where(site.outputs),
                  site.kind.value, policy)
    return fused


def _where(outputs) -> str:
    """Where a site's outputs are in the model: each one's source line (`` at file.py:12 `code` ``), its FX node's
    name where none is known."""
    return " at " + ", ".join(source_of(out) or f"FX node {out.name}" for out in outputs)


NORM_NAMES = {"rms": "RMSNorm", "layer": "LayerNorm"}


def replace_norms(graph: Graph, options: FusionOptions) -> int:
    """Put ``h3_fused::eager_rms_norm`` (or its statistics, ``eager_rms_norm_rstd``, where an elementwise op reads
    the norm: ``patterns.norms.replace_norm``) or ``h3_fused::eager_layer_norm`` where ``graph`` has an RMSNorm or a
    LayerNorm outside its sites, on tensors whose policy is ``bf16`` (with ``options.eager_norms``); the number
    replaced."""
    if not options.eager_norms:
        return 0
    kept = 0
    renamed = {}  # outputs of replaced norms -> the op's outputs (the input of a norm after it)
    for found in find_norms(graph, lambda node, why: refuse(node, why, "a norm kept as eager computes it"),
                            wanted=lambda node: resolve_policy(options.dtype_policy, device_of(node)) == "bf16"):
        name, where = found.output.name, source_of(found.output, " at ")
        found.norm.x = renamed.get(found.norm.x, found.norm.x)
        renamed[found.output] = replace_norm(graph, found)
        kept += 1
        op = f"eager_{found.norm.kind}_norm"
        count(op)
        how = (f"h3_fused::{op}_rstd, its products left to Inductor to fuse into what reads them"
               if found.statistics_alone else f"h3_fused::{op}")
        log.debug("h3_fused: the %s %s%s computed as eager computes it (%s)", NORM_NAMES[found.norm.kind], name,
                  where, how)
    return kept
