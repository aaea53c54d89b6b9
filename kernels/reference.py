"""Pure-torch implementation of the fused modulation, on any device.

It performs the eager graph's operations in the eager order, in fp32 (fp64 for fp64 activations), rounding
to the activation dtype ``A`` exactly where ``Rounding`` says, so run eagerly on the CPU under the ``bf16``
policy it is bit-identical to the unfused model (the norm with one rounding *is* ``F.rms_norm``, as
``nn.RMSNorm`` calls it). It is the ops' body for CPU tensors and devices Triton must not be launched on
(under ``torch.compile`` Inductor compiles its operations), and the test oracle of the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .arguments import ModulationArgs
from .contract import LOW_PRECISION, compensated

f32 = torch.float32


def _round(v: torch.Tensor, dtype: torch.dtype, rounds: bool) -> torch.Tensor:
    """``v`` rounded to ``dtype`` and back to its own dtype where ``rounds``, else ``v``."""
    return v.to(dtype).to(v.dtype) if rounds else v


def sum_rounded_once(residual: torch.Tensor, gate_rows: torch.Tensor, branch: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``R_A(res + gate_rows * branch)`` of the exact sum, rounded once to ``A`` = ``dtype`` (bf16 or fp16,
    the operands' dtype), as fp32 values: what one fused multiply-add in ``A`` stores.

    The product of two bf16/fp16 values is exact in fp64; TwoSum gives the fp64 sum ``s`` and its exact
    error ``e``. ``s + e`` is then rounded to fp32 by round-to-odd (toward zero, the last bit set where
    inexact), which keeps what the final rounding needs: fp32 has more than one bit beyond ``A``'s, so
    rounding that value to ``A`` rounds the exact sum once. Rounding through fp32 instead (fp32
    arithmetic, or torch's fp64 -> bf16 conversion, which passes through fp32) rounds twice, which differs
    where the product is a tie of ``A`` and the residual lies below fp32's last place of it: 103.75 (a
    tie of bf16) minus 3e-7 rounds to 103.5 once and to 104 twice."""
    r = residual.double()
    p = gate_rows.double() * branch.double()
    s = r + p
    t = s - r
    e = (r - (s - t)) + (p - t)
    f = s.float()
    rest = (s - f.double()) + e  # the exact sum minus f: 0 exactly where f is exact, else of its sign
    beyond = ((rest < 0) & (f > 0)) | ((rest > 0) & (f < 0))
    bits = f.view(torch.int32) - beyond.to(torch.int32)  # one place toward zero, either sign
    odd = (bits | (rest != 0).to(torch.int32)).view(f32)
    return torch.where(torch.isfinite(s), odd, s.float()).to(dtype).to(f32)


def rows_of(table: torch.Tensor, a: ModulationArgs, copies: bool = False, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The ``[R, H]`` modulation rows of ``table`` for ``a``'s rows: gathered by the index, or the given rows
    (``[B, T, H]``, broadcast) flattened, plus their ``bias`` where given (``Rounding.row_sum``: the sum in the
    compute dtype, rounded to the rows' dtype where it rounds); ``copies`` (``shift`` and ``scale`` of ``M``
    copies): ``[M * R, H]``, copy ``j``'s rows ``j * R`` on."""
    if a.gathered and copies and a.copies is not None:
        return table.unflatten(0, (a.copies, -1)).index_select(1, a.index.long()).flatten(0, 1)
    if a.gathered:
        return table.index_select(0, a.index.long())
    rows = table.reshape(-1, a.hidden)
    if bias is None:
        return rows
    total = rows.to(a.compute_dtype) + bias.to(a.compute_dtype)
    return total.to(rows.dtype) if a.rounding.row_sum else total


def gated_residual(a: ModulationArgs) -> torch.Tensor:
    """``u = R_A(res + [R_A](gate[idx] * branch))``, in the activation dtype.

    Under ``fp32`` (``Rounding.fused_multiply_add``) with the gate table in the activation dtype (bf16 or
    fp16), the exact sum is rounded once (``sum_rounded_once``), as the CUDA kernel's multiply-add in that
    dtype does; otherwise the fp32 product is added in fp32 and rounded, as eager does (for an fp32 gate
    table under ``fp32`` the kernel's fp32 FMA skips the rounding of the product: the sums can differ in
    fp32's last place, and so, rarely, the stored residuals)."""
    gate_rows = rows_of(a.gate, a, bias=a.gate_bias)
    if a.rounding.fused_multiply_add and gate_rows.dtype == a.dtype and a.dtype in LOW_PRECISION:
        return sum_rounded_once(a.residual, gate_rows, a.branch, a.dtype).to(a.dtype)
    c = a.compute_dtype
    product = _round(gate_rows.to(c) * a.branch.to(c), a.dtype, a.rounding.gate_product)
    return (a.residual.to(c) + product).to(a.dtype)


def rms_norm(u: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    """``n`` of ``u`` (activation dtype), as values of ``a.compute_dtype``: ``R_A(u*r*w)``, ``R_A(R_A(u*r)*w)`` or
    unrounded, ``r = rsqrt(mean(u^2)+eps)``."""
    r = a.rounding
    if r.norm_output and not r.norm_before_weight:
        return F.rms_norm(u, (a.hidden,), a.weight, a.eps).to(a.compute_dtype)
    u = u.to(a.compute_dtype)
    normed = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + a.eps)
    if a.weight is None:
        return _round(normed, a.dtype, r.norm_output)
    normed = _round(normed, a.dtype, r.norm_before_weight)
    return _round(normed * a.weight.to(normed.dtype), a.dtype, r.norm_output)


def layer_norm(u: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    """``n`` of ``u`` (activation dtype), as values of ``a.compute_dtype``: ``R_A((u - mean) * r * w)`` or
    unrounded, ``r = rsqrt(var + eps)`` (the biased variance), as ``F.layer_norm`` computes it."""
    if a.rounding.norm_output:
        return F.layer_norm(u, (a.hidden,), a.weight, None, a.eps).to(a.compute_dtype)
    weight = a.weight.to(a.compute_dtype) if a.weight is not None else None
    return F.layer_norm(u.to(a.compute_dtype), (a.hidden,), weight, None, a.eps)


def norm(u: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    return layer_norm(u, a) if a.norm == "layer" else rms_norm(u, a)


def modulate(n: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    """``y = R_A([R_A](n * [R_A](1 + scale[idx])) + shift[idx])`` in the activation dtype.

    Under ``fp32`` (``Rounding.fused_multiply_add``) the CUDA kernel computes ``n * p + shift`` as one
    FMA; this reference rounds the product to fp32 first, so the two can differ by a last-bit flip of the
    output, each within the policy. With copies of the rows, ``[M, R, H]``: each copy's modulation of ``n``, one
    expression a copy (stacked), so that a compiler computes them in one pass over ``n`` as eager's graph is."""
    scale, shift = (rows_of(t, a, copies=True, bias=b).to(n.dtype)
                    for t, b in ((a.scale, a.scale_bias), (a.shift, a.shift_bias)))

    def modulated(scale, shift):
        one_plus = _round(1.0 + scale, a.dtype, a.rounding.affine)
        return (_round(n * one_plus, a.dtype, a.rounding.affine) + shift).to(a.dtype)

    if a.copies is None:
        return modulated(scale, shift)
    return torch.stack([modulated(*rows) for rows in zip(scale.chunk(a.copies), shift.chunk(a.copies))])


def reference_modulation(a: ModulationArgs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(u, y)`` for the site ``a`` describes: A gives ``(None, y)``, B ``(u, y)``, C ``(u, None)``; ``y`` holds
    ``a.modulations`` modulations of the one norm."""
    u = gated_residual(a).view(a.out_shape) if a.gate is not None else None
    if a.scale is None:
        return u, None
    n = norm((u if u is not None else a.x).reshape(-1, a.hidden), a)
    return u, modulate(n, a).view(a.y_shape)


def _index_sum(rows: torch.Tensor, index: torch.Tensor, num_rows: int, exact: bool = False) -> torch.Tensor:
    """``out[k] = sum of rows[t] where index[t] == k``, in the rows' dtype, summed in the rows' order (``exact``:
    in fp64, for a gradient rounded to fp32, where the fp32 sum's own error would show)."""
    total = rows.double() if exact else rows
    return total.new_zeros(num_rows, rows.shape[-1]).index_add_(0, index, total)


def reference_backward(a: ModulationArgs, u: torch.Tensor | None, dy: torch.Tensor | None, du: torch.Tensor | None,
                       needs) -> dict[str, torch.Tensor]:
    """The gradients ``needs`` asks for (``launch_backward.Needs``), by the backward contract of ``contract.Rounding``
    (the rows gathered by an index: ``backward.SavedSite.gathered`` restates given rows so):
    keys ``lead`` (``dx``, or ``dresidual``), ``branch``, ``gate``, ``weight``, ``shift``, ``scale``, each in its
    input's dtype and shape. ``u`` is what the forward normalized (``x``, or the stored residual; ``[R, H]``),
    ``dy``/``du`` the incoming gradients of ``y`` and ``u`` (``[R, H]``; ``dy`` ``[M * R, H]`` with ``M`` copies of
    ``shift`` and ``scale``). Arithmetic in fp32 (fp64 for fp64 activations); table and weight gradients are summed
    in that precision and rounded once. With copies the norm's output gradient is the sum of the copies'
    ``dn_j = R(dy_j * p_j)``, in copy order, each addition rounded where ``dn`` is (eager's autograd adds the
    gradients a tensor receives in its dtype; two additions' order cannot change the sum)."""
    compute = a.compute_dtype
    rnd = a.rounding
    idx = a.index.long()
    copies = a.modulations
    keys = torch.arange(copies, device=idx.device)[:, None] * a.num_table_rows + idx  # copy j's rows: table j

    def R(v, rounds):
        return v.to(a.dtype).to(compute) if rounds else v

    def table_sum(name, rows):  # a compensated gradient: the fp64 sum rounded once, as the kernel's Kahan sum
        table = getattr(a, name)
        index = idx if name == "gate" else keys.flatten()
        return _index_sum(rows, index, table.shape[0], exact=compensated(table))

    sums = {}
    if a.scale is not None:
        dy_c = dy.to(compute)
        u_c = u.to(compute)
        if a.norm == "layer":
            u_c = u_c - u_c.mean(-1, keepdim=True)
        r = torch.rsqrt(u_c.pow(2).mean(-1, keepdim=True) + a.eps)
        xhat = u_c * r
        p = R(1.0 + rows_of(a.scale, a, copies=True).to(compute), rnd.affine)
        terms = R(dy_c * p, rnd.norm_output).chunk(copies)
        dn = terms[0]
        for term in terms[1:]:
            dn = R(dn + term, rnd.norm_output)
        w = a.weight.to(compute) if a.weight is not None else None
        dxhat = R(dn * w, rnd.norm_before_weight) if w is not None else dn
        centred = dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        if a.norm == "layer":
            centred = centred - dxhat.mean(-1, keepdim=True)
        du_n = R(r * centred, rnd.input_gradient)
        du_t = R(du.to(compute) + du_n, rnd.input_gradient) if a.gate is not None else du_n
        normed = R(xhat, rnd.norm_before_weight)
        n = R(normed * w if w is not None else normed, rnd.norm_output)
        if needs.shift:
            sums["shift"] = table_sum("shift", dy_c)
        if needs.scale:
            sums["scale"] = table_sum("scale", dy_c * n.repeat(copies, 1))
        if needs.weight and w is not None:
            sums["weight"] = (dn * normed).sum(0, dtype=torch.float64 if compensated(a.weight) else None)
    else:
        du_t = du.to(compute)
    grads = {}
    if needs.lead:
        grads["lead"] = du_t.to(a.dtype, copy=True)  # never the incoming gradient itself
    if a.gate is not None:
        if needs.branch:
            grads["branch"] = (du_t * a.gate.index_select(0, idx).to(compute)).to(a.dtype)
        if needs.gate:
            sums["gate"] = table_sum("gate", du_t * a.branch.to(compute))
    for name, total in sums.items():
        grads[name] = total.to(getattr(a, name).dtype)
    return grads
