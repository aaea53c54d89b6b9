"""Argument checking for the fused modulation ops.

Every op reads activations ``[..., H]`` as ``R`` rows of ``H`` (row-strided views are read in place; other
layouts are copied) and takes its modulation rows (``shift``, ``scale``, ``gate``) from one of two row sources:

- ``index`` given: tables ``[K, H]`` with any row stride, and an int32/int64 ``index`` shaped like the activations
  without the last dim (read as ``R`` contiguous entries: other layouts are copied), a table row per token;
  ``shift`` and ``scale`` may be ``[M, K, H]``, ``M`` copies of the tables (read as ``[M * K, H]``);
- ``index`` None: rows that broadcast to the activations, ``H`` wide (one per sample, ``[B, 1, H]`` or
  ``[B, H][:, None]``; one per token, ``[B, T, H]``; one for all, ``[H]``), read in place as ``[B, T, H]``
  views whose sample and token strides may be 0. A site with a norm may take ``shift`` and ``scale`` with one
  more leading dim than the activations, of ``M`` copies (``[M, B, 1, H]``), read as ``[M * B, T, H]``.

With copies, ``y`` is ``M`` modulations of the one norm, ``[M, ...]``, as torch broadcasts
``norm(x) * (1 + scale) + shift`` (SD3.5's norm modulated twice).

Given rows may come with a bias each (``gate_bias``, ``shift_bias``, ``scale_bias``: an ``[H]`` row added to every
row, all of the site's rows or none; no copies): the modulation is then ``rows + bias``, summed as
``contract.Rounding.row_sum`` says (Wan's and LTX-Video's ``scale_shift_table + temb`` per token, without the
``[B, T, H]`` sums ever written).

A plain norm (``x`` and its weight, no tables) has neither. Bad input raises ``ValueError``/``TypeError`` naming
the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract import Rounding, rounding_for
from .policy import check_policy, resolve_policy

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # fp64: the reference only
TABLE_DTYPES = ACTIVATION_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)
NORMS = ("rms", "layer")


def check_tensor(name: str, t: object, dtypes) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def as_rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``[..., H]`` as ``[R, H]`` with unit column stride: a view when the layout allows, else a copy."""
    if t.dim() < 1 or t.shape[-1] != hidden:
        raise ValueError(f"{name} must have last dim H={hidden}, got shape {tuple(t.shape)}")
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 or hidden == 1 else rows.contiguous()


def check_table(name: str, t: object, hidden: int, copies: int | None = None) -> torch.Tensor:
    """A ``[K, H]`` table, or with ``copies`` (``M``) ``[M, K, H]`` tables read as ``[M * K, H]``, with unit
    column stride (a copy where the layout has not)."""
    check_tensor(name, t, TABLE_DTYPES)
    dims = 2 if copies is None else 3
    if t.dim() != dims or t.shape[-1] != hidden:
        form = f"a [K, H={hidden}] table" if copies is None else f"[M={copies}, K, H={hidden}] tables"
        raise ValueError(f"{name} must be {form}, got shape {tuple(t.shape)}")
    if t.shape[-2] == 0:
        raise ValueError(f"{name} must have at least one row")
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def check_rows(name: str, t: object, shape: torch.Size, copies: int | None = None) -> torch.Tensor:
    """Modulation rows broadcast to the activations of ``shape``, as a ``[B, T, H]`` view (``B`` the product of
    the leading dims before the token dim, ``T`` the token dim), or with ``copies`` (``M``, rows with a leading
    dim of copies) as ``[M * B, T, H]``: a view of ``t`` where the strides allow, else a copy."""
    check_tensor(name, t, TABLE_DTYPES)
    hidden = shape[-1]
    full = shape if copies is None else torch.Size((copies, *shape))
    if t.dim() == 0 or t.shape[-1] != hidden or t.dim() > len(full) or any(
            n != 1 and n != s for n, s in zip(reversed(t.shape), reversed(full))):
        raise ValueError(f"{name} must be rows of H={hidden} that broadcast to the activations {tuple(shape)}"
                         f"{f' with a leading dim of {copies} copies' if copies is not None else ''}, "
                         f"got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and hidden != 1:
        t = t.contiguous()
    tokens = shape[-2] if len(shape) > 1 else 1
    samples = t.new_empty(full[:-2]).numel() if len(full) > 2 else 1
    expanded = t.expand(full)
    try:
        return expanded.view(samples, tokens, hidden)
    except (RuntimeError, ValueError):  # leading dims whose strides do not merge (fake tensors raise ValueError)
        return expanded.reshape(samples, tokens, hidden)


def check_row_biases(biases: dict, given: dict, index, copies, hidden: int) -> dict[str, torch.Tensor]:
    """The biases of the given rows (``biases``: name of the rows -> an ``[H]`` row or None), each contiguous: all
    of the rows ``given`` or none, without an index or copies. Returns the rows' names to their biases."""
    present = {name: b for name, b in biases.items() if b is not None}
    if not present:
        return {}
    for name, b in present.items():
        if name not in given:
            raise ValueError(f"{name}_bias is given without {name}")
        check_tensor(f"{name}_bias", b, TABLE_DTYPES)
        if b.shape != (hidden,):
            raise ValueError(f"{name}_bias must have shape [H={hidden}], got {tuple(b.shape)}")
    if index is not None:
        raise ValueError("row biases (" + ", ".join(f"{k}_bias" for k in present) + ") add to rows given without "
                         "an index; with an index, add them to the tables")
    if copies is not None:
        raise ValueError("row biases are not taken with copies of shift and scale")
    if set(present) != set(given):
        raise ValueError("every modulation row takes a bias or none: got " + ", ".join(f"{k}_bias" for k in present)
                         + " for rows " + ", ".join(given))
    return {name: b.contiguous() for name, b in present.items()}


def modulation_copies(shift: object, scale: object, dims: int) -> int | None:
    """``M`` where ``shift`` and ``scale`` carry a leading dim of copies beyond their ``dims`` (the activations'
    for given rows, 2 for tables), both the same ``M``, else None."""
    extra = {name: t.shape[0] for name, t in (("shift", shift), ("scale", scale))
             if isinstance(t, torch.Tensor) and t.dim() == dims + 1}
    if not extra:
        return None
    if len(extra) == 1 or extra["shift"] != extra["scale"] or 0 in extra.values():
        raise ValueError(f"shift and scale must both have {dims} dims or both one more (a leading dim of M >= 1 "
                         f"copies), got shapes {tuple(shift.shape)} and {tuple(scale.shape)}")
    return extra["shift"]


def check_index_on_host(index: torch.Tensor, num_table_rows: int) -> None:
    """Raise ``IndexError`` naming the first entry of ``index`` outside ``[0, num_table_rows)`` (where the kernel
    cannot raise: under the interpreter, and before the reference's gathers, whose error names no row). The
    bounds come from one reduction; the entry is looked for only where they fail."""
    if index.numel() == 0:
        return
    low, high = torch.aminmax(index)
    if low.item() < 0 or high.item() >= num_table_rows:
        bad = (index < 0) | (index >= num_table_rows)
        first = int(bad.nonzero()[0, 0])
        raise IndexError(f"index out of range: index[{first}] = {int(index[first])} is not in [0, {num_table_rows})")


@dataclass(frozen=True)
class ModulationArgs:
    """Checked, flattened arguments of one fused call (``None`` where a site does not use one)."""

    x: torch.Tensor | None  # site A input rows
    residual: torch.Tensor | None  # sites B, C
    branch: torch.Tensor | None
    gate: torch.Tensor | None  # [K, H] with an index; else [B, T, H] rows (sample and token strides, maybe 0)
    weight: torch.Tensor | None
    shift: torch.Tensor | None
    scale: torch.Tensor | None
    index: torch.Tensor | None  # None where the rows are given as rows, and for a plain norm
    out_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    eps: float
    policy: str
    rounding: Rounding
    has_norm: bool = True  # site A or B, or a plain norm; site C has none
    norm: str = "rms"  # "rms": x * rsqrt(mean(x^2) + eps); "layer": (x - mean) * rsqrt(var + eps)
    copies: int | None = None  # M: shift and scale with a leading dim of M copies (read as [M * K, H] tables or
    # [M * B, T, H] rows), y [M, ...]
    gate_bias: torch.Tensor | None = None  # [H] rows added to the given rows (all of them or none)
    shift_bias: torch.Tensor | None = None
    scale_bias: torch.Tensor | None = None
    stores_rstd: bool = False  # a plain RMSNorm storing each row's r = rsqrt(mean(x^2) + eps) (fp32) instead of y

    @property
    def row_bias(self) -> bool:
        """Whether the given rows come with biases (``check_row_biases``)."""
        return any(b is not None for b in (self.gate_bias, self.shift_bias, self.scale_bias))

    @property
    def y_shape(self) -> torch.Size:
        """``y``'s shape: the activations', or with ``copies`` ``[M, ...]``."""
        return self.out_shape if self.copies is None else torch.Size((self.copies, *self.out_shape))

    @property
    def modulations(self) -> int:
        """How many modulations of the one norm ``y`` holds (``M``, or 1)."""
        return 1 if self.copies is None else self.copies

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the reference computes in: fp64 for fp64 activations, else fp32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def rows(self) -> int:
        return self.index.numel() if self.index is not None else self.lead.shape[0]

    @property
    def lead(self) -> torch.Tensor:
        """The rows the outputs are shaped as: ``x`` or the residual."""
        return self.x if self.x is not None else self.residual

    @property
    def static_rows(self) -> int | None:
        """The row count, or None where it is symbolic (a graph compiled for dynamic shapes)."""
        return self.rows if isinstance(self.rows, int) else None

    @property
    def hidden(self) -> int:
        return self.out_shape[-1]

    @property
    def has_affine(self) -> bool:
        return self.scale is not None

    @property
    def tables(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.gate, self.shift, self.scale) if t is not None)

    @property
    def gathered(self) -> bool:
        """Whether the modulation rows are gathered from ``[K, H]`` tables by the index (else they are given as
        ``[B, T, H]`` rows; a plain norm has none)."""
        return self.index is not None

    @property
    def num_table_rows(self) -> int:
        """``K``, the rows every table (each copy of ``shift`` and ``scale``) has, where gathered (0 otherwise)."""
        if not self.gathered:
            return 0
        return self.gate.shape[0] if self.gate is not None else self.scale.shape[0] // self.modulations

    @property
    def tokens(self) -> int:
        """The rows of one sample where the modulation rows are given as ``[B, T, H]`` rows (``T``; else 1)."""
        return self.tables[0].shape[1] if self.tables and not self.gathered else 1


def check_args(*, x=None, residual=None, branch=None, gate=None, weight=None, shift=None, scale=None,
               index=None, gate_bias=None, shift_bias=None, scale_bias=None, eps: float = 0.0, policy: str,
               norm_rounds_before_weight: bool = False, upcast_tables: bool = False, has_norm: bool,
               norm: str = "rms", norm_in_fp32: bool = False, stores_rstd: bool = False) -> ModulationArgs:
    """The checked arguments of a site (tables gathered by ``index``, or rows given without one, maybe with
    biases), or of a plain norm of ``x`` (``has_norm``, no tables, no index). ``norm``: ``"rms"`` or ``"layer"``;
    ``norm_in_fp32``: the norm is computed on the activations upcast to fp32 and its output is not rounded (the
    affine then fp32); ``stores_rstd``: a plain RMSNorm without weight whose output is each row's ``r``."""
    check_policy(policy)
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    lead = x if x is not None else residual
    lead_name = "x" if x is not None else "residual"
    check_tensor(lead_name, lead, ACTIVATION_DTYPES)
    if lead.dim() < 1:
        raise ValueError(f"{lead_name} must have at least one dim [..., H], got a scalar")
    hidden = lead.shape[-1]
    dtype, device, shape = lead.dtype, lead.device, lead.shape
    if branch is not None:
        check_tensor("branch", branch, ACTIVATION_DTYPES)
        if branch.shape != shape:
            raise ValueError(f"branch must have the shape of residual {tuple(shape)}, got {tuple(branch.shape)}")
        if branch.dtype != dtype:
            raise TypeError(f"branch must have the dtype of residual ({dtype}), got {branch.dtype}")
    given = {k: v for k, v in {"gate": gate, "shift": shift, "scale": scale}.items() if v is not None}
    plain_norm = has_norm and x is not None and not given
    if plain_norm and index is not None:
        raise ValueError("index must be None for a norm without modulation tables")
    if stores_rstd and not (plain_norm and norm == "rms" and weight is None):
        raise ValueError("stores_rstd takes a plain RMSNorm of x without weight, modulation rows or index")
    copies = modulation_copies(shift, scale, 2 if index is not None else len(shape)) if has_norm else None
    if index is not None:
        check_tensor("index", index, INDEX_DTYPES)
        if index.shape != shape[:-1]:
            raise ValueError(f"index must have the shape of the activations without the last dim "
                             f"{tuple(shape[:-1])}, got {tuple(index.shape)}")
        tables = {k: check_table(k, v, hidden, copies if k != "gate" else None) for k, v in given.items()}
        counts = {k: v.shape[-2] for k, v in given.items()}
        if any(n != next(iter(counts.values())) for n in counts.values()):  # SymInts: no set
            raise ValueError("the tables must have the same rows K, got " + ", ".join(
                f"{k} {n}" for k, n in counts.items()))
    else:
        tables = {k: check_rows(k, v, shape, copies if k != "gate" else None) for k, v in given.items()}
    biases = check_row_biases(dict(gate=gate_bias, shift=shift_bias, scale=scale_bias), given, index, copies, hidden)
    # the modulation's dtype: the rows', or that of their sum with the biases
    row_dtypes = {k: torch.promote_types(v.dtype, biases[k].dtype) if k in biases else v.dtype
                  for k, v in tables.items()}
    if shift is not None and scale is not None:
        if row_dtypes["shift"] != row_dtypes["scale"]:
            raise TypeError(f"shift and scale must share a dtype, got {row_dtypes['shift']} and {row_dtypes['scale']}"
                            f"{' (with their biases)' if biases else ''}")
    if weight is not None:
        check_tensor("weight", weight, ACTIVATION_DTYPES)
        if weight.shape != (hidden,):
            raise ValueError(f"weight must have shape [H={hidden}], got {tuple(weight.shape)}")
        if weight.dtype not in (dtype, torch.float32):  # as RMSNorm: the input's dtype, or fp32 master weights
            raise TypeError(f"weight must have the dtype of {lead_name} ({dtype}) or torch.float32, got {weight.dtype}")
        weight = weight.contiguous()
    if has_norm:
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    named = {lead_name: lead, "branch": branch, "index": index, "weight": weight, **tables,
             **{f"{k}_bias": b for k, b in biases.items()}}
    for name, t in named.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but {lead_name} is on {device}")
    resolved = resolve_policy(policy, device)
    rounding = rounding_for(resolved, dtype, row_dtypes.get("gate"), row_dtypes.get("shift"),
                            norm_rounds_before_weight=norm_rounds_before_weight, upcast_tables=upcast_tables,
                            norm_in_fp32=norm_in_fp32, layer_norm=norm == "layer",
                            row_sum=next(iter(row_dtypes.values())) if biases else None)
    return ModulationArgs(
        x=as_rows("x", x, hidden) if x is not None else None,
        residual=as_rows("residual", residual, hidden) if residual is not None else None,
        branch=as_rows("branch", branch, hidden) if branch is not None else None,
        gate=tables.get("gate"), weight=weight, shift=tables.get("shift"), scale=tables.get("scale"),
        index=index.reshape(-1).contiguous() if index is not None else None, out_shape=shape, dtype=dtype,
        device=device, eps=float(eps), policy=resolved, rounding=rounding, has_norm=has_norm, norm=norm,
        copies=copies, gate_bias=biases.get("gate"), shift_bias=biases.get("shift"), scale_bias=biases.get("scale"),
        stores_rstd=stores_rstd,
    )
