"""What the pass fused, kept beside Inductor's compile caches, so that counters and logs stay truthful on a hit.

On an FX graph cache or AOT autograd cache hit Inductor loads the compiled code without running the
post-grad passes: the pass neither counts nor logs what the loaded code fuses. So after every compile the
backend records the counts the pass made under a key of what was compiled (Dynamo's graph, the inputs'
metadata, the options, the pass's uuid), in ``<Inductor cache dir>/h3_fused/``, and on a compile in which the
pass did not run it counts and logs what was recorded for that key.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from .logs import count, log


def compile_key(gm: torch.fx.GraphModule, example_inputs, patches: dict) -> str:
    """A key of what one backend call compiles: the graph's code, each input's metadata, the config patches
    (our pass by its uuid, which hashes the package's sources and options)."""
    inputs = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), t.requires_grad)
              if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
    settings = {k: v.uuid().hex() if hasattr(v, "uuid") and callable(v.uuid) and v.uuid() else repr(v)
                for k, v in sorted(patches.items())}
    digest = hashlib.sha256(repr((gm.code, inputs, settings, torch.__version__)).encode())
    return digest.hexdigest()


def _path(key: str) -> str:
    return os.path.join(cache_dir(), "h3_fused", f"{key}.json")


def remember(key: str, made: dict) -> None:
    """Keep the counts one compile made (``{"norm_modulate": 1, "refused": 2, ...}``)."""
    path = _path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        json.dump(made, f)
    os.replace(partial, path)  # atomic: a reader in another process sees all of it or nothing


def recall(key: str) -> None:
    """Count and log what the compile that produced the cached code for ``key`` fused (nothing if unknown)."""
    try:
        with open(_path(key)) as f:
            made = json.load(f)
    except (OSError, ValueError):
        return
    for name, n in made.items():
        count(name, n)
    log.debug("h3_fused: compiled code loaded from Inductor's cache; when compiled it fused %s",
              ", ".join(f"{name} {n}" for name, n in made.items()) or "nothing")
