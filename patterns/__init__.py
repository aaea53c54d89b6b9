"""Search/replace of the AdaLN modulation sites, and of the RMSNorms outside them, in aten FX graphs (no kernel
internals here)."""

from .graph_view import NoMatch
from .norms import find_norms, replace_norm
from .replacements import replace_site
from .search import find_sites
from .sites import (
    Site,
    SiteKind,
    gate_residual_site,
    is_affine_candidate,
    is_gated_candidate,
    merge_gate_and_norm,
    norm_modulate_site,
)

__all__ = [
    "NoMatch", "Site", "SiteKind", "find_norms", "find_sites", "gate_residual_site", "is_affine_candidate",
    "is_gated_candidate", "merge_gate_and_norm", "norm_modulate_site", "replace_norm", "replace_site",
]
