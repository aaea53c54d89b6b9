"""The ``h3_fused`` torch.compile backend: Inductor with ``H3FusionPass`` as its post-grad pass, and for graphs
that compute gradients the sites fused before autograd (``training.py``).

    torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})

``options`` other than ``dtype_policy`` and ``mode=`` behave as they do for Inductor. A post-grad
custom pass the user already set (one, or on torch 2.13 on a list of them) is chained after ours, never dropped.
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
from h3_fused.kernels.policy import resolve_policy
from torch._dynamo.utils import counters
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx

from .cached import compile_key, recall, remember
from .eager_roundings import KeepEagerRoundings, keep_eager_linspace, rewrites_needed
from .graph_pass import H3FusionPass
from .logs import LOG_NAME
from .options import FusionOptions
from .toolkit_libdevice import link_toolkit_libdevice
from .training import computes_gradients, fuse_before_autograd


def _user_pass_setting(inductor_options: dict, name: str):
    """The custom-pass setting ``name`` the user made (in ``options`` or the global config)."""
    return inductor_options.pop(name, getattr(inductor_config, name))


def graph_device(example_inputs) -> torch.device:
    """The device the graph computes on: that of its first tensor input on an accelerator, else CPU."""
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


# Inductor's own settings for eager's numerics in the code it generates, where this torch has them:
# ``emulate_precision_casts`` keeps eager's intermediate roundings; ``eager_numerics.division_rounding`` divides
# fp32 by IEEE division (``div_rn``) as eager's kernels do, where Triton's ``/`` is approximate;
# ``eager_numerics.disable_ftz`` keeps denormals, which Triton flushes to zero and eager's kernels do not;
# ``eager_numerics.use_pytorch_libdevice`` takes transcendental functions (pow, erf, ...) from the CUDA toolkit's
# libdevice, as eager's kernels do, instead of Triton's bundled one (a last place apart).
EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding", "eager_numerics.disable_ftz",
                  "eager_numerics.use_pytorch_libdevice")


def eager_numerics_patches() -> dict:
    """``{setting: True}`` for each of ``EAGER_NUMERICS`` this torch's Inductor config has (``eager_numerics`` is
    newer than ``emulate_precision_casts``, and ``use_pytorch_libdevice`` newer than its other two)."""
    return _set_where_known(EAGER_NUMERICS)


# Inductor launches the Triton kernels of user ops (ours) through Triton's own launcher unless told it may use
# its static launcher, as it does for the kernels it generates; where this torch has the setting, it is on
STATIC_LAUNCH = "static_launch_user_defined_triton_kernels"


def static_launch_patches() -> dict:
    """``{STATIC_LAUNCH: True}`` where this torch's Inductor config has the setting, else nothing."""
    return _set_where_known((STATIC_LAUNCH,))


def _set_where_known(names) -> dict:
    """``{name: True}`` for each of ``names`` this torch's Inductor config has."""
    known = inductor_config.get_config_copy().keys()
    return {name: True for name in names if name in known}


def keeps_eager_bits(fusion: FusionOptions, device: torch.device) -> bool:
    """Whether a compile under ``fusion`` on ``device`` keeps eager's bits (the ``bf16`` policy there)."""
    return resolve_policy(fusion.dtype_policy, device) == "bf16"


def make_config_patches(options: dict | None = None, mode: str | None = None,
                        device: torch.device = torch.device("cpu"), fuse_post_grad: bool = True,
                        source: str | None = None) -> dict:
    """Inductor config patches for one compile: mode options, the static launch of our kernels
    (``static_launch_patches``), under the ``bf16`` policy Inductor's settings for eager's numerics
    (``eager_numerics_patches``) and, where this torch's Inductor drops a rounding of eager's whatever those say,
    ``KeepEagerRoundings`` as its joint-graph pre-pass (the user's chained after it), the caller's
    options (which override the settings), and our pass; under ``bf16`` with CUDA, where Inductor cannot, it points
    Triton at the CUDA toolkit's libdevice (``toolkit_libdevice.link_toolkit_libdevice``, for the process)
    (``fuse_post_grad=False``: it only chains the user's passes, the sites having been fused before autograd;
    ``source``: the code of the Dynamo graph compiled, ``H3FusionPass.source``)."""
    fusion, inductor_options = FusionOptions.split(options)
    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(static_launch_patches())
    eager_bits = keeps_eager_bits(fusion, device)
    if eager_bits:
        patches.update(eager_numerics_patches())
        if torch.version.cuda:
            link_toolkit_libdevice()
    chained = _user_pass_setting(inductor_options, "post_grad_custom_post_pass")
    joint_chained = _user_pass_setting(inductor_options, "joint_custom_pre_pass")
    patches.update(inductor_options)
    patches["post_grad_custom_post_pass"] = H3FusionPass(fusion, chained, fuse=fuse_post_grad, source=source)
    if eager_bits and rewrites_needed():
        patches["joint_custom_pre_pass"] = KeepEagerRoundings(joint_chained)
    elif joint_chained is not None:
        patches["joint_custom_pre_pass"] = joint_chained
    return patches


def h3_fused_backend(gm: torch.fx.GraphModule, example_inputs, *, options: dict | None = None,
                     mode: str | None = None):
    """Compile ``gm`` with Inductor and the h3_fused pass (the ``"h3_fused"`` backend); a graph that computes
    gradients has its sites fused before autograd instead. Under ``bf16`` ``torch.linspace`` is eager's kernel
    (``eager_roundings.keep_eager_linspace``)."""
    training = computes_gradients(example_inputs)
    device, fusion = graph_device(example_inputs), FusionOptions.split(options)[0]
    if keeps_eager_bits(fusion, device):
        keep_eager_linspace(gm)
    patches = make_config_patches(options, mode, device, fuse_post_grad=not training, source=gm.code)
    if training:
        gm = fuse_before_autograd(gm, example_inputs, fusion) or gm
    key = compile_key(gm, example_inputs, patches)
    before = counters[LOG_NAME].copy()
    compiled = compile_fx(gm, example_inputs, config_patches=patches)
    made = {name: n - before[name] for name, n in counters[LOG_NAME].items() if n != before[name]}
    if made:
        remember(key, made)
    elif not training:  # the pass did not run: Inductor loaded the code from its cache
        recall(key)
    return compiled
