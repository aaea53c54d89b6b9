"""The kernel's sm_90 schedule, compiled without a GPU: site A's activation loads do not wait for the index.

SASS issues in order, and an instruction that reads a load's result waits for it. If ptxas places any
instruction that reads the index (the bounds check, a table row's address) before the loads of the
row's activations (``x``, or ``res`` and ``branch``), those loads wait one round trip of the index load
in every program (docs/DESIGN.md, "The index assertion's place"). These tests hold site A's builds as the
ops launch them (many rows, one row, 3,072 rows; each policy) to issuing all of the row's activation loads
(the ``.cg`` loads, ``LDG...STRONG.GPU`` in SASS) before the first instruction that reads an index load's
result (``LDG.E.64`` for an int64 index, ``LDG.E`` for int32). Sites B and C are not held to it: in their
builds the gate row's address arithmetic comes first, and holding them to it made B slower.
"""

from __future__ import annotations

import re

import pytest
from h3_fused.kernels.testing import shipped_launch_config
from sass import compile_site, instructions

HIDDEN = 5376
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
REGISTER = re.compile(r"(?<![A-Z])R(\d+)")
ACTIVATION_LOAD = re.compile(r"LDG\S*STRONG\.GPU")


def activation_loads_before_index_wait(sass: list[str], index_load: str) -> tuple[int, int, str | None]:
    """(activation loads issued before the first instruction that reads the result of an ``index_load``
    (the opcode loading the index), all activation loads, that instruction)."""
    index_registers: set[int] = set()
    before, total, waiting = 0, 0, None
    for ins in sass:
        opcode, _, operands = PREDICATE.sub("", ins).rstrip(" ;").partition(" ")
        operands = [o.strip() for o in operands.split(",")] if operands else []
        if ACTIVATION_LOAD.match(opcode):
            total += 1
            before += waiting is None
            continue
        if waiting is not None:
            continue
        sources = operands if opcode.startswith(("ST", "BRA", "CALL")) else operands[1:]
        if any(int(r) in index_registers for s in sources for r in REGISTER.findall(s)):
            waiting = ins
        elif opcode == index_load:
            first = int(REGISTER.match(operands[0]).group(1))
            index_registers |= {first, first + 1} if index_load.endswith(".64") else {first}
    return before, total, waiting


@pytest.mark.parametrize("index, index_load", [("i64", "LDG.E.64"), ("i32", "LDG.E")], ids=["int64", "int32"])
@pytest.mark.parametrize("rows", [None, 1, 3072], ids=["many_rows", "one_row", "rows_3072"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_no_activation_load_of_site_a_waits_for_the_index(policy, rows, index, index_load):
    kernel = compile_site("A", policy, HIDDEN, shipped_launch_config("A", HIDDEN, rows, policy), index=index)
    before, total, waiting = activation_loads_before_index_wait(instructions(kernel.asm["cubin"]), index_load)
    assert total > 0, "no activation load found"
    assert before == total, f"{total - before} of {total} activation loads wait for the index ({waiting!r} first)"
