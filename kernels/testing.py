"""The modulation sites as an unfused model writes them, inputs for them, and calls of the fused ops and kernel on
them: the one catalogue the tests and the benchmarks share.

- ``eager_norm``, ``eager_modulate``, ``eager_gate``: the pieces of a site in eager, in each public spelling
  (``nn.RMSNorm`` / ``F.rms_norm`` or the native norm; tables upcast or not); ``eager_site`` composes them into
  site A (``y`` from ``x``), B (``(u, y)`` from the residual and the branch) or C (``u``);
- ``site_tensors``: every tensor a site may read (the tables as strided ``[K, H]`` chunk views of one
  ``[K, 6H]`` projection, as the model holds them); ``make_inputs``: those of one site, keyed as its op takes them;
- ``fused_site``: a call of the site's public op; ``kernel_launch``: of the forward kernel alone, with any launch
  configuration; ``site_rounding``, ``shipped_sum_order``, ``shipped_launch_config``: what the launch picks;
  ``backward_inputs``: what the backward kernels' launch takes;
- ``minimal_bytes``: what a site must read and write, the benchmarks' roof.

The DiT family's forms (``FamilyForm``: the norm and its spelling, where the rows come from, fp32 rows with the
norm and affine of the fp32 upcast) have their own: ``family_modulation``, ``family_rows``, ``family_inputs``,
``family_modulations``, ``family_op_rows``, ``family_op_gate``, ``family_op_biases`` (rows summed with a table:
the ops' biases), ``family_eager_site``, ``family_exact_site``, ``family_fused_site``, ``family_backward_inputs`` and
``family_minimal_bytes``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import launch as shipped_launch
from .arguments import ModulationArgs, check_args
from .backward import SavedSite, rows_of
from .contract import Rounding, SumOrder, rounding_for
from .launch import LaunchConfig, launch_config, norm_sum_order
from .ops import gate_norm_modulate, gate_residual, norm_modulate

SITES = ("A", "B", "C")
INDEX_LAYOUTS = ("uniform", "runs")


def eager_norm(x, weight, eps, native: bool = False):
    """RMSNorm over the last dim: ``F.rms_norm`` (one rounding), or the native spelling (``native``), which
    rounds the normalized row before the weight."""
    if not native:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return n * weight if weight is not None else n


def eager_modulate(n, shift, scale, index, upcast: bool = False):
    """``(n * (1 + scale[index]) + shift[index]).to(n.dtype)``, the tables ``.float()`` first where ``upcast``."""
    if upcast:
        shift, scale = shift.float(), scale.float()
    return (n * (1.0 + scale[index.long()]) + shift[index.long()]).to(n.dtype)


def eager_gate(residual, gate, branch, index, upcast: bool = False):
    """``(residual + gate[index] * branch).to(residual.dtype)``, the table ``.float()`` first where ``upcast``."""
    if upcast:
        gate = gate.float()
    return (residual + gate[index.long()] * branch).to(residual.dtype)


def eager_site(site: str, native: bool = False, upcast: bool = False):
    """The eager function of ``site`` the fused op replaces, taking ``make_inputs(site, ...)``'s keys."""
    def a(x, weight, shift, scale, index, eps):
        return eager_modulate(eager_norm(x, weight, eps, native), shift, scale, index, upcast)

    def b(residual, gate, branch, weight, shift, scale, index, eps):
        u = eager_gate(residual, gate, branch, index, upcast)
        return u, a(u, weight, shift, scale, index, eps)

    def c(residual, gate, branch, index):
        return eager_gate(residual, gate, branch, index, upcast)

    return {"A": a, "B": b, "C": c}[site]


def site_tensors(tokens: int = 33, hidden: int = 96, table_rows: int = 6, *, device="cpu", dtype=torch.bfloat16,
                 table_dtype=None, lead=None, seed: int = 0, index_dtype=torch.int64, index_layout: str = "uniform"):
    """Every tensor a site may read: ``x`` and ``branch`` of shape ``[*lead, H]`` (``lead`` defaults to
    ``(tokens,)``), a ``weight`` near 1, ``shift``, ``scale`` and ``gate`` as chunk views of one ``[K, 6H]``
    table (row stride ``6H``, as in the model) and an ``index`` of shape ``lead``, from one generator on
    ``device``. ``index_layout``: ``uniform``, each row's table row drawn independently (the worst case for the
    table rows' reuse in a program's L1), or ``runs``, the same draw sorted into contiguous runs, as the model
    lays its index out (each sample's tokens share a timestep and each modality's tokens are adjacent)."""
    if index_layout not in INDEX_LAYOUTS:
        raise ValueError(f"index_layout must be one of {INDEX_LAYOUTS}, got {index_layout!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    lead = tuple(lead or (tokens,))

    def randn(*shape, scale=1.0, to=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(scale).to(to)

    tables = randn(table_rows, 6 * hidden, scale=0.3, to=table_dtype or dtype).chunk(6, dim=-1)
    index = torch.randint(0, table_rows, lead, generator=g, device=device)
    if index_layout == "runs":
        index = index.flatten().sort().values.view(lead)
    weight = 1.0 + randn(hidden, scale=0.1)
    x, branch = randn(*lead, hidden), randn(*lead, hidden)
    return dict(x=x, branch=branch, weight=weight, shift=tables[0], scale=tables[1], gate=tables[2],
                index=index.to(index_dtype))


SITE_INPUTS = {"A": ("x", "weight", "shift", "scale", "index", "eps"),
               "B": ("residual", "gate", "branch", "weight", "shift", "scale", "index", "eps"),
               "C": ("residual", "gate", "branch", "index")}


def make_inputs(site: str, tokens: int, hidden: int = 5376, table_rows: int = 6, *, device="cuda", eps=1e-5,
                **options):
    """The inputs of ``site`` (``site_tensors(..., **options)``; its ``x`` is the residual of sites B and C), keyed
    as the site's op and ``eager_site`` take them; real sizes and a CUDA device by default."""
    t = dict(site_tensors(tokens, hidden, table_rows, device=device, **options), eps=eps)
    t["residual"] = t["x"]
    return {name: t[name] for name in SITE_INPUTS[site]}


def fused_site(site: str, policy: str, *, dispatcher: bool = False, **flags):
    """A call of the site's public function (``h3_fused.kernels.*``: in eager, the op's body without the
    dispatcher) with ``make_inputs``' keys, the tensors passed positionally as a model passes them;
    ``dispatcher=True``: of the op through the dispatcher (``torch.ops.h3_fused.*``), as a tracer or mode sees it.
    ``flags``: the op's other keyword arguments (``norm_rounds_before_weight``, ``upcast_tables``)."""
    public = {"A": norm_modulate, "B": gate_norm_modulate, "C": gate_residual}[site]
    op = public.dispatched if dispatcher else public
    tensors = [name for name in SITE_INPUTS[site] if name != "eps"]
    if site == "C":
        return lambda **t: op(*(t[name] for name in tensors), policy=policy, **flags)
    return lambda **t: op(*(t[name] for name in tensors), eps=t["eps"], policy=policy, **flags)


def kernel_launch(site: str, inputs: dict, policy: str, wrap=lambda kernel: kernel, kernel_module=None,
                  outputs=None, config: LaunchConfig | None = None, free_sum_order: bool = False):
    """A call that launches the fused kernel alone on ``inputs`` (arguments checked once, outputs allocated
    once; no op dispatch) and returns what the launch returns (the compiled kernel); the call's ``outputs``
    attribute holds ``(u, y)`` (None where the site has no such output). ``config``: a ``LaunchConfig`` to launch
    with instead of the shipped one. ``kernel_module``: another version of ``h3_fused.kernels.launch`` to launch
    instead. ``outputs``: the ``outputs`` of another call on inputs of the same shapes, to write into instead of
    allocating (calls timed side by side share them: with outputs of their own, identical kernels differed by up
    to 1.7%, the same way in every run, by where their outputs lay). ``free_sum_order``: the norm's squares added
    in the kernel's own order, not an eager kernel's (the policy's other roundings kept), with the configuration
    ``launch_config`` picks for that."""
    launch = (kernel_module or shipped_launch).launch_modulation
    a = check_args(**inputs, policy=policy, has_norm=site != "C")
    if free_sum_order:
        a = dataclasses.replace(a, rounding=dataclasses.replace(a.rounding, norm_sum_order=SumOrder.OWN))
    if outputs is None:
        outputs = tuple(torch.empty(a.out_shape, dtype=a.dtype, device=a.device) if wanted else None
                        for wanted in (site != "A", site != "C"))
    u, y = outputs

    def call():
        return launch(a, u, y, wrap, config)

    call.outputs = (u, y)
    return call


def backward_inputs(site: str, tokens: int, hidden: int, table_rows: int = 6, *, device="cuda", seed: int = 0,
                    policy: str = "bf16", native: bool = False) -> tuple[ModulationArgs, tuple]:
    """What ``launch_backward.launch_backward`` takes for ``site``: the forward's checked arguments and the
    ``[R, H]`` rows ``(u, dy, du)``: what the forward normalized (``x``, or the stored residual), the incoming
    gradients of ``y`` and ``u``, each None where the site has no such value. The index is ``a.index``."""
    t = site_tensors(tokens, hidden, table_rows, device=device, seed=seed)
    incoming = site_tensors(tokens, hidden, table_rows, device=device, seed=seed + 1)
    gated, normed = site != "A", site != "C"
    saved = SavedSite(t["x"] if normed else None, t["branch"] if gated else None, t["gate"] if gated else None,
                      t["weight"] if normed else None, t["shift"] if normed else None, t["scale"] if normed else None,
                      t["index"], eps=1e-5, policy=policy, norm_rounds_before_weight=native, upcast_tables=False)
    dy, du = (incoming["x"] if normed else None), (incoming["branch"] if gated else None)
    a = saved.forward_args(du)
    return a, (rows_of(saved.u, a, "u"), rows_of(dy, a, "dy"), rows_of(du, a, "du"))


def site_rounding(site: str, policy: str, native: bool = False, norm: str = "rms") -> Rounding:
    """The ``contract.Rounding`` of ``site`` under ``policy`` with bf16 activations and tables, for the
    ``nn.RMSNorm`` spelling, the native one (``native``) or a LayerNorm (``norm="layer"``)."""
    gate, normed = site != "A", site != "C"
    return rounding_for(policy, torch.bfloat16, torch.bfloat16 if gate else None, torch.bfloat16 if normed else None,
                        norm_rounds_before_weight=native, upcast_tables=False, layer_norm=norm == "layer")


def shipped_sum_order(site: str, hidden: int, rows: int | None, policy: str, native: bool = False,
                      norm: str = "rms") -> SumOrder:
    """The ``NORM_SUM_ORDER`` the launch picks for ``site`` (see ``site_rounding``) at ``rows`` rows."""
    return norm_sum_order(site_rounding(site, policy, native, norm), hidden, site != "C", rows)


def shipped_launch_config(site: str, hidden: int, rows: int | None, policy: str, native: bool = False,
                          norm: str = "rms") -> LaunchConfig:
    """The configuration ``launch_config`` picks for ``site`` (A: a norm; B: a gate and a norm; C: a gate) at
    ``hidden`` columns and ``rows`` rows (None: a symbolic count) under ``policy`` (see ``site_rounding``)."""
    return launch_config(hidden, site != "A", site != "C", rows,
                         shipped_sum_order(site, hidden, rows, policy, native, norm))


def minimal_bytes(site: str, tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Each activation read once and each output written once (tables and index are negligible)."""
    streams = {"A": 2, "B": 4, "C": 3}[site]
    return streams * tokens * hidden * itemsize


FAMILY_SOURCES = ("per_sample", "per_token", "one_for_all", "chosen")
TABLE_PLUS_ROWS = "per_token_table"  # a source the fused ops take with biases: forward only (no backward for them)


@dataclasses.dataclass(frozen=True)
class FamilyForm:
    """How a DiT of the family writes its sites. ``norm``: ``"layer"`` (``F.layer_norm``, no affine), ``"rms"``
    (``F.rms_norm``) or ``"diffusers_rms"`` (diffusers' ``RMSNorm`` without weight: the bf16 activations times the
    fp32 ``rsqrt`` of the mean of the squares, cast back); ``source``: modulation rows one per sample (``[B, 1, H]``
    chunks of one ``[B, 6H]`` projection), one per token (``[B, T, H]``), one for all (``[H]``), or chosen per token
    between two per sample by ``torch.where`` (Qwen-Image-Edit's ``zero_cond_t``: a ``[2B, 6H]`` projection, the
    first B rows where the token's ``choice`` holds), or (``TABLE_PLUS_ROWS``) one per token that is the sum of a
    bf16 ``[B, T, 6H]`` projection and a ``[6H]`` table, as Wan 2.2 TI2V (an fp32 table plus the projection
    upcast) and LTX-Video (both bf16) sum theirs, which the fused ops take as the projection's rows with the
    table's as biases; ``in_fp32``: the rows fp32, the norm of the fp32 upcast with
    the affine and the gated residual in fp32, one cast (Wan); ``modulations``: how many times the one norm output
    is modulated (SD3.5's ``SD35AdaLayerNormZeroX``: twice; rows given, not chosen)."""

    norm: str = "layer"
    source: str = "per_sample"
    in_fp32: bool = False
    modulations: int = 1

    def __post_init__(self):
        if self.modulations not in (1, 2) or (self.modulations > 1 and self.source in ("chosen", TABLE_PLUS_ROWS)):
            raise ValueError(f"FamilyForm: modulations must be 1 or 2 (2 with rows given, not chosen or summed with a "
                             f"table), got {self.modulations} with {self.source!r} rows")

    def __str__(self) -> str:
        """The form in a test's or a printout's terms: ``norm-source``, ``-fp32`` where ``in_fp32``, ``-x2`` where
        modulated twice."""
        return f"{self.norm}-{self.source}{'-fp32' if self.in_fp32 else ''}{'-x2' if self.modulations > 1 else ''}"

    def op_flags(self) -> dict:
        """The fused ops' keywords for this form."""
        return dict(norm="rms" if self.norm != "layer" else "layer", norm_in_fp32=self.in_fp32,
                    norm_rounds_before_weight=self.norm == "diffusers_rms")


# every form the tests hold: each norm with each source, and the LayerNorm of the fp32 upcast with fp32 rows (Wan's)
FAMILY_FORMS = tuple(FamilyForm("layer", source, in_fp32) for source in FAMILY_SOURCES for in_fp32 in (False, True)) + \
    tuple(FamilyForm(norm, source) for norm in ("rms", "diffusers_rms") for source in FAMILY_SOURCES)


def family_modulation(form: FamilyForm, batch: int, tokens: int, hidden: int, *, device, generator) -> torch.Tensor:
    """The modulation projection a model of ``form`` chunks its rows from, 0.3 times normal values: ``[B, 6H]``
    per sample, ``[B, T, 6H]`` per token, ``[6H]`` for all, ``[2B, 6H]`` for a choice; fp32 where ``in_fp32``, else
    bf16."""
    shape = {"per_token": (batch, tokens), "one_for_all": (), "per_sample": (batch,), "chosen": (2 * batch,),
             TABLE_PLUS_ROWS: (batch, tokens)}[form.source]
    dtype = torch.float32 if form.in_fp32 and form.source != TABLE_PLUS_ROWS else torch.bfloat16
    return (0.3 * torch.randn(*shape, 6 * hidden, generator=generator, device=device)).to(dtype)


def _chunks(form: FamilyForm, modulation: torch.Tensor, choice: torch.Tensor | None, count: int,
            table: torch.Tensor | None = None) -> tuple:
    """The first ``count`` of the projection's 6 chunks as a model of ``form`` uses them: viewed ``[:, None]`` per
    sample (broadcast over the tokens); chosen per token, ``torch.where(choice[..., None], first half, second
    half)`` with a condition written once per row, as Qwen-Image writes it; summed with the ``table`` first
    (``TABLE_PLUS_ROWS``: the projection upcast where ``in_fp32``)."""
    if form.source == TABLE_PLUS_ROWS:
        return (table + (modulation.float() if form.in_fp32 else modulation)).chunk(6, -1)[:count]
    rows = modulation.chunk(6, -1)[:count]
    if form.source == "chosen":
        samples = modulation.shape[0] // 2
        return tuple(torch.where(choice[..., None] == 1, r[:samples, None], r[samples:, None]) for r in rows)
    return tuple(r[:, None] for r in rows) if form.source == "per_sample" else rows


def family_rows(form: FamilyForm, modulation: torch.Tensor, choice: torch.Tensor | None = None,
                table: torch.Tensor | None = None) -> tuple:
    """``(shift, scale, gate)`` as a model of ``form`` takes them from its projection (chunks 0, 1 and 2)."""
    return _chunks(form, modulation, choice, 3, table)


def family_modulations(form: FamilyForm, modulation: torch.Tensor, choice: torch.Tensor | None = None,
                       table: torch.Tensor | None = None) -> list:
    """The ``(shift, scale)`` of each of ``form``'s modulations of its one norm output: chunks 0 and 1, then (a
    second modulation, as SD3.5's) chunks 3 and 4."""
    rows = _chunks(form, modulation, choice, 5, table)
    return [(rows[0], rows[1]), (rows[3], rows[4])][:form.modulations]


def family_op_rows(form: FamilyForm, modulation: torch.Tensor, choice: torch.Tensor | None = None) -> tuple:
    """``(shift, scale)`` as the fused ops take them for ``form``: its one modulation's rows, or where modulated twice
    the two modulations' rows as copies, stacked (``[2, B, 1, H]`` per sample); ``TABLE_PLUS_ROWS``: the projection's
    rows, without the table (``family_op_biases``)."""
    if form.source == TABLE_PLUS_ROWS:
        return modulation.chunk(6, -1)[:2]
    pairs = family_modulations(form, modulation, choice)
    if form.modulations == 1:
        return pairs[0]
    return tuple(torch.stack([r.view((1,) * (3 - r.dim()) + tuple(r.shape)) for r in copies]) for copies in zip(*pairs))


def family_op_gate(form: FamilyForm, modulation: torch.Tensor, choice: torch.Tensor | None = None) -> torch.Tensor:
    """The gate's rows as the fused ops take them for ``form`` (``TABLE_PLUS_ROWS``: the projection's, without the
    table)."""
    return modulation.chunk(6, -1)[2] if form.source == TABLE_PLUS_ROWS else family_rows(form, modulation, choice)[2]


def family_op_biases(form: FamilyForm, table: torch.Tensor | None, names=("shift", "scale")) -> dict:
    """The biases the fused ops take for ``form`` (``TABLE_PLUS_ROWS``: the table's chunks), keyed ``{name}_bias``
    for each of ``names`` (of ``gate``, ``shift``, ``scale``: chunks 2, 0, 1); none for the other sources."""
    if form.source != TABLE_PLUS_ROWS:
        return {}
    chunks = dict(zip(("shift", "scale", "gate"), table.chunk(6)))
    return {f"{name}_bias": chunks[name] for name in names}


def family_inputs(site: str, form: FamilyForm, batch: int, tokens: int, hidden: int, *, device="cuda",
                  seed: int = 0) -> dict:
    """The inputs of ``site`` in ``form``, keyed as ``family_eager_site`` and ``family_fused_site`` take them: bf16
    activations ``[batch, tokens, hidden]`` (``x`` for A, ``residual`` and ``branch`` for B and C) and the
    ``modulation`` projection (``family_modulation``), which each site chunks as the model does, and for
    ``TABLE_PLUS_ROWS`` the ``table`` summed with it."""
    g = torch.Generator(device=device).manual_seed(seed)
    lead, branch = (torch.randn(batch, tokens, hidden, generator=g, device=device).to(torch.bfloat16) for _ in range(2))
    rows = dict(modulation=family_modulation(form, batch, tokens, hidden, device=device, generator=g))
    if form.source == TABLE_PLUS_ROWS:
        table = 0.3 * torch.randn(6 * hidden, generator=g, device=device)
        rows["table"] = table if form.in_fp32 else table.to(torch.bfloat16)
    if form.source == "chosen":  # the first half of each sample's tokens one way, the rest the other
        rows["choice"] = (torch.arange(tokens, device=device) < tokens // 2).to(torch.int32).expand(batch, tokens)
    if site == "A":
        return dict(x=lead, **rows)
    return dict(residual=lead, branch=branch, **rows)


def family_eager_site(site: str, form: FamilyForm, eps: float = 1e-6):
    """The eager function of ``site`` as a model of ``form`` writes it, rows chunked from the projection
    (``family_rows``, ``family_modulations``): ``u = res + gate * branch`` (in fp32 with one cast where ``in_fp32``);
    ``y = norm(x) * (1 + scale) + shift`` cast to the activations' dtype, the norm of ``x.float()`` where
    ``in_fp32``; modulated twice, ``y`` and ``y2`` of the one norm (outputs ``(y, y2)``, ``(u, y, y2)``)."""
    def norm(x):
        base = x.float() if form.in_fp32 else x
        if form.norm == "layer":
            return F.layer_norm(base, (base.shape[-1],), eps=eps)
        if form.norm == "rms":
            return F.rms_norm(base, (base.shape[-1],), eps=eps)
        return (base * torch.rsqrt(base.float().pow(2).mean(-1, keepdim=True) + eps)).to(base.dtype)

    def modulated(x, modulation, choice, table):
        n = norm(x)
        return tuple((n * (1 + scale) + shift).type_as(x)
                     for shift, scale in family_modulations(form, modulation, choice, table))

    def gated(residual, gate, branch):
        return (residual.float() + branch * gate).type_as(residual) if form.in_fp32 else residual + gate * branch

    def a(x, modulation, choice=None, table=None):
        ys = modulated(x, modulation, choice, table)
        return ys if form.modulations > 1 else ys[0]

    def b(residual, branch, modulation, choice=None, table=None):
        u = gated(residual, family_rows(form, modulation, choice, table)[2], branch)
        return u, *modulated(u, modulation, choice, table)

    def c(residual, branch, modulation, choice=None, table=None):
        return gated(residual, family_rows(form, modulation, choice, table)[2], branch)

    return {"A": a, "B": b, "C": c}[site]


def family_exact_site(site: str, form: FamilyForm, eps: float = 1e-6):
    """``site``'s math in ``form`` without the form's casts, for fp64 inputs (the oracle of its gradients):
    ``family_eager_site`` of the same norm and rows, no fp32 upcast (``x.float()`` would compute an fp64 graph's
    norm in fp32), diffusers' ``RMSNorm`` as ``F.rms_norm``."""
    exact = dataclasses.replace(form, in_fp32=False, norm="rms" if form.norm == "diffusers_rms" else form.norm)
    return family_eager_site(site, exact, eps)


def family_fused_site(site: str, form: FamilyForm, policy: str, eps: float = 1e-6):
    """A call of ``site``'s public op on ``family_inputs(site, form, ...)``, its outputs as ``family_eager_site``'s
    (modulated twice: the rows of the two modulations as copies, stacked, and ``y`` unbound)."""
    flags = dict(form.op_flags(), eps=eps, policy=policy)
    rows = functools.partial(family_op_rows, form)

    def outputs(y):
        return tuple(y.unbind(0)) if form.modulations > 1 else (y,)

    def a(x, modulation, choice=None, table=None):
        ys = outputs(norm_modulate(x, None, *rows(modulation, choice), None, **family_op_biases(form, table), **flags))
        return ys if form.modulations > 1 else ys[0]

    def b(residual, branch, modulation, choice=None, table=None):
        u, y = gate_norm_modulate(residual, family_op_gate(form, modulation, choice), branch, None,
                                  *rows(modulation, choice), None,
                                  **family_op_biases(form, table, ("gate", "shift", "scale")), **flags)
        return u, *outputs(y)

    def c(residual, branch, modulation, choice=None, table=None):
        return gate_residual(residual, family_op_gate(form, modulation, choice), branch, None,
                             **family_op_biases(form, table, ("gate",)), policy=policy)

    return {"A": a, "B": b, "C": c}[site]


def family_backward_inputs(site: str, form: FamilyForm, batch: int, tokens: int, hidden: int, *, device="cuda",
                           seed: int = 0, policy: str = "bf16", shared_rows: bool = False):
    """What ``launch_backward.launch_backward`` takes for ``site`` in ``form``: ``(saved, a, (u, dy, du))``, the
    site's ``SavedSite`` with its given rows restated as tables gathered by an index (``SavedSite.gathered``; its
    ``ordered_index`` is the launch's), the forward's checked arguments and the ``[R, H]`` rows. ``shared_rows``:
    one row per token shared by the samples (``[1, T, H]``: an index whose order is not the rows')."""
    if shared_rows and form.modulations > 1:
        raise ValueError("family_backward_inputs: shared_rows takes a form modulated once")
    if form.source == TABLE_PLUS_ROWS:
        raise ValueError(f"family_backward_inputs: rows with biases ({TABLE_PLUS_ROWS}) have no backward")

    def lead_of(inputs):
        return inputs.get("x", inputs.get("residual"))

    t = family_inputs(site, form, batch, tokens, hidden, device=device, seed=seed)
    gate = family_rows(form, t["modulation"], t.get("choice"))[2]
    shift, scale = family_op_rows(form, t["modulation"], t.get("choice"))
    if shared_rows:
        shift, scale, gate = (r[:1] for r in (shift, scale, gate))
    incoming = family_inputs(site, form, batch, tokens, hidden, device=device, seed=seed + 1)
    lead = lead_of(t)
    normed, gated = site != "C", site != "A"
    flags = form.op_flags()
    saved = SavedSite(lead if normed else None, t["branch"] if gated else None, gate if gated else None, None,
                      shift if normed else None, scale if normed else None, None, eps=1e-6, policy=policy,
                      upcast_tables=False, **flags).gathered(lead.shape)
    du = incoming["branch"] if gated else None
    a = saved.forward_args(du)
    dy = lead_of(incoming) if normed else None
    if normed and form.modulations > 1:  # y's gradient: one for each modulation
        dy = torch.stack([dy, *(lead_of(family_inputs(site, form, batch, tokens, hidden, device=device,
                                                      seed=seed + 1 + j)) for j in range(1, form.modulations))])
    return saved, a, tuple(rows_of(v, a, name) for v, name in ((saved.u, "u"), (dy, "dy"), (du, "du")))


def family_minimal_bytes(site: str, form: FamilyForm, inputs: dict) -> int:
    """What ``site`` must move: each activation read once and each output written once (a ``y`` per modulation),
    and the rows it uses wherever they are one per token (rows per sample or for all, and a choice's index per
    token, are negligible)."""
    lead = inputs.get("x", inputs.get("residual"))
    rows = lead.numel() // lead.shape[-1]
    modulation = inputs["modulation"]
    extra = form.modulations - 1 if site != "C" else 0  # the further modulations' outputs and rows
    per_token = 0 if form.source not in ("per_token", TABLE_PLUS_ROWS) else (
        {"A": 2, "B": 3, "C": 1}[site] + 2 * extra) * (
        modulation.numel() // 6 * modulation.element_size())
    return minimal_bytes(site, rows, lead.shape[-1], lead.element_size()) + extra * lead.numel() * \
        lead.element_size() + per_token
