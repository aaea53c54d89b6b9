"""Finding every site of a graph: candidates by a cheap filter, matched, then each site C whose stored residual
feeds a site A merged with it into one B-shaped site."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import Graph, Node

from .graph_view import VIEW, NoMatch, expect, source_of
from .sites import (
    SPLITS,
    Site,
    gate_residual_site,
    is_affine_candidate,
    is_gated_candidate,
    merge_gate_and_norm,
    norm_modulate_site,
)

NORM_CANDIDATE = "a norm followed by `* (1 + scale[idx]) + shift[idx]` (site A)"
GATE_CANDIDATE = "a gated residual `res + gate[idx] * branch` (site C)"
aten = torch.ops.aten


# cheap operations without side effects that a merged site's late inputs may be moved up through: views of the
# modulation rows and a choice's condition
HOISTABLE = VIEW + SPLITS + (aten.slice.Tensor, aten.select.int, aten.expand.default, aten.eq.Scalar, aten.ne.Scalar,
                             operator.getitem)


def _hoistable(node: Node, limit: int, position: dict[Node, int], chain: list[Node]) -> bool:
    """Whether ``node`` comes before position ``limit``, or can be moved there: a ``HOISTABLE`` operation whose
    inputs come before it or can be moved too (``chain`` gathers those to move, each after its inputs)."""
    if position[node] < limit or node in chain:
        return True
    if node.op != "call_function" or node.target not in HOISTABLE:
        return False
    if not all(_hoistable(arg, limit, position, chain) for arg in node.all_input_nodes):
        return False
    chain.append(node)
    return True


def _ready_before_use(site: Site, position: dict[Node, int]) -> None:
    """A merged site computes both outputs at once, so every input must come before the first use of either
    output outside it. A late input that is a view of rows computed before that use (a slice of a chunk, as a
    model writes ``rows[:B]`` where it uses them) is moved up before it; a model that computes the next norm's
    modulation rows after using the residual keeps its gated residual and its norm as two sites."""
    inside = set(site.interior) | set(site.outputs)
    users = [u for out in site.outputs for u in out.users if u not in inside]
    if not users:
        return
    first_use = min(users, key=position.__getitem__)
    chain: list[Node] = []
    expect(all(_hoistable(n, position[first_use], position, chain) for n in site.inputs.values() if n is not None),
           "the residual is used before the norm's modulation rows are computed")
    for k, node in enumerate(chain):  # each after its inputs, all before the first use
        first_use.prepend(node)
        position[node] = position[first_use] - 1 + (k + 1) / (len(chain) + 1)


def find_sites(graph: Graph, refuse: Callable[[Node, NoMatch, str], None], note=lambda message: None,
               unmergeable: Callable[[Site], str | None] = lambda site: None, row_biases: bool = False) -> list[Site]:
    """The sites of ``graph`` in graph order of their matching: A (or B, merged), then the C not merged.
    ``refuse(node, why, kind)`` hears of every candidate that is not a site (``kind``: what it looked like);
    ``note`` of merges not made; ``unmergeable(site)``: why a merged site would not do where its two parts would
    (in a graph that computes gradients, what the merged site's backward lacks), or None; ``row_biases``: rows per
    token from a sum with a row shared by all are taken as rows with a bias, so that the sum is never written
    (``sites.match_rows``; the op has no backward for them: inference graphs only)."""
    a_sites: dict[Node, Site] = {}
    c_sites: dict[Node, Site] = {}
    copies: set[Node] = set()  # the outputs of a site's other modulations of its norm (matched with it)
    for node in graph.nodes:
        if node.op != "call_function" or node in copies:
            continue
        matcher, found, kind = ((norm_modulate_site, a_sites, NORM_CANDIDATE) if is_affine_candidate(node) else
                                (gate_residual_site, c_sites, GATE_CANDIDATE) if is_gated_candidate(node) else
                                (None, None, None))
        if matcher is None:
            continue
        try:
            site = matcher(node, row_biases)
        except NoMatch as why:
            refuse(node, why, kind)
            continue
        found[site.outputs[0]] = site
        copies.update(site.outputs[1:])
    sites, merged = [], set()
    position = {n: i for i, n in enumerate(graph.nodes)}
    for a in a_sites.values():
        c = c_sites.get(a.inputs["x"])
        if c is not None:
            try:
                site = merge_gate_and_norm(c, a)
                why = unmergeable(site)
                expect(why is None, why)
                _ready_before_use(site, position)
                sites.append(site)
                merged.add(c.outputs[0])
                continue
            except NoMatch as why:
                note(f"not merging the gated residual{source_of(c.outputs[0], ' at ')} into the norm"
                     f"{source_of(a.outputs[0], ' at ')}: {why}")
        sites.append(a)
    return sites + [c for u, c in c_sites.items() if u not in merged]
