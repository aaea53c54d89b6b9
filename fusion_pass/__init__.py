"""h3_fused: a torch.compile backend that fuses the AdaLN modulation sites of MiniMax-H3.

    model = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
    compile_repeated_blocks(model)                       # regional compile, one graph for all blocks
"""

from .backend import h3_fused_backend, make_config_patches
from .graph_pass import H3FusionPass
from .options import FusionOptions
from .regional import compile_repeated_blocks, find_repeated_block_classes

__all__ = ["FusionOptions", "H3FusionPass", "compile_repeated_blocks", "find_repeated_block_classes",
           "h3_fused_backend", "make_config_patches"]
