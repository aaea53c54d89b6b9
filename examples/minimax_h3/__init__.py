"""A faithful, unfused stand-in of the MiniMax-H3 video DiT, built from its published architecture."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import H3Config, Spellings
from .layers import AdaLNProj, FinalLayer, H3Block, SwiGLU, TimeEmbedder
from .model import H3Model, TokenLayout, example_inputs, init_weights
from .modulation import NativeRMSNorm, build_table_index, modulate_gate, modulate_scale_shift
from .parallel import UlyssesGroup, enable_ulysses, gather_rows, shard_rows
from .sampler import euler_sample

__all__ = [
    "AdaLNProj", "CheckpointError", "FinalLayer", "H3Block", "H3Config", "H3Model", "NativeRMSNorm",
    "Spellings", "SwiGLU", "TimeEmbedder", "TokenLayout", "UlyssesGroup", "build_table_index",
    "enable_ulysses", "euler_sample", "example_inputs", "gather_rows", "init_weights", "load_checkpoint",
    "modulate_gate", "modulate_scale_shift", "save_checkpoint", "shard_rows",
]
