"""A Python model of the leftover rotation of the 4-part group / cluster GEMV kernels
(backends/engine/kernels/gemv_kq.cu kq_row_part, kernels/xstage.cuh cs_entries / cs_entry), run
on the CPU: which super-blocks each part's lanes read for a row, and which x entries each part
stages. The model mirrors the kernel's integer expressions; the GPU test
tests/test_engine_kernels.py::test_csplit_nodes_are_bitwise_equal_to_the_split_kernels checks the
kernels themselves against the float64 oracle.

Invariants: every super-block of a row is read by exactly one part (lane group), always by a part
that staged it; over NP consecutive rounds every part takes each leftover group once (so a warp's
rows cost ng / NP groups on average instead of ceil(ng / NP) in part 0); without the rotation the
session-19 mapping is kept. A model that forgets to stage the leftovers must fail.
"""
from __future__ import annotations

import pytest

GROUPS_PER_WARP = 4  # lane groups of an 8-lane row: 4 super-blocks per warp per iteration


def kq_row(nsb: int, sb0: int, st: int) -> list[int]:
    """gemv_kq.cu kq_row's super-blocks: sb0, sb0 + st, ... below nsb."""
    return list(range(sb0, nsb, st))


def part_sbs(nsb: int, grp: int, wpart: int, rnd: int, NP: int, rot: bool) -> list[int]:
    """Super-blocks lane group grp of part wpart reads in a row of round rnd (kq_row_sel)."""
    if not rot:
        return kq_row(nsb, grp + 4 * wpart, 4 * NP)
    ng = (nsb + 3) >> 2
    F, L = ng // NP, ng - (ng // NP) * NP
    out = kq_row(min(nsb, 4 * F * NP), grp + 4 * wpart, 4 * NP)
    for m in range(L):
        if (m + rnd) % NP == wpart:
            out += kq_row(nsb, 4 * (F * NP + m) + grp, 4 * NP)
    return out


def staged_sbs(nsb: int, cs: int, part: int, rot: bool) -> set[int]:
    """Super-blocks whose x entries part `part` stages (stage_xq with cs_entries / cs_entry:
    32 entries of 8 values per super-block, 128 per group of 4)."""
    nch = nsb * 32
    ng = (nch + 127) >> 7
    nv = 128 * (ng // cs + ng % cs) if rot else (128 * ((ng - part + cs - 1) // cs) if ng > part else 0)
    out = set()
    for v in range(nv):
        g = v >> 7
        if rot:
            F = ng // cs
            c = ((g * cs + part if g < F else F * cs + g - F) << 7) | (v & 127)
        else:
            c = ((g * cs + part) << 7) | (v & 127)
        if c < nch:
            out.add(c // 32)
    return out


@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("NP", [2, 4])
def test_every_super_block_once_and_staged(NP, rot):
    for nsb in list(range(1, 80)) + [136, 199]:
        staged = [staged_sbs(nsb, NP, p, rot) for p in range(NP)]
        for rnd in range(2 * NP + 1):
            seen: dict[int, int] = {}
            for p in range(NP):
                for grp in range(GROUPS_PER_WARP):
                    for sb in part_sbs(nsb, grp, p, rnd, NP, rot):
                        assert sb in staged[p], (nsb, NP, rnd, p, sb)
                        seen[sb] = seen.get(sb, 0) + 1
            assert sorted(seen) == list(range(nsb)) and set(seen.values()) == {1}, (nsb, NP, rnd)


def test_rotation_balances_the_parts():
    """K = 17408 (68 super-blocks, 17 groups) at 4 parts: session 19's part 0 read 5 groups of
    every row (5 iterations of each lane group) and parts 1..3 read 4; rotated, every part
    averages 4.25 iterations over 4 rounds and never takes more than ceil(17 / 4) = 5."""
    nsb, NP = 68, 4
    its = lambda p, r, rot: len(part_sbs(nsb, 0, p, r, NP, rot))  # lane group 0's iterations
    assert [its(p, 0, False) for p in range(NP)] == [5, 4, 4, 4]
    assert all(its(p, r, False) == its(p, 0, False) for p in range(NP) for r in range(8))
    for p in range(NP):
        per_round = [its(p, r, True) for r in range(NP)]
        assert sum(per_round) / NP == 4.25 and max(per_round) == 5, (p, per_round)


def test_a_model_without_staged_leftovers_fails():
    """The rotation needs every part to stage the leftover groups: with session 19's staging, a
    part other than 0 reads an unstaged super-block in some round."""
    nsb, NP = 68, 4
    missing = [(p, r, sb) for r in range(NP) for p in range(NP) for grp in range(GROUPS_PER_WARP)
               for sb in part_sbs(nsb, grp, p, r, NP, True) if sb not in staged_sbs(nsb, NP, p, False)]
    assert missing and {p for p, _, _ in missing} == {1, 2, 3}


def test_row_group_key_balances_for_an_odd_group_count():
    """GGUF_HARNESS_GEMV_KQ_PART_ROT=row keys the leftover on the row group n = cb + round ncb
    (a function of the row, not of the grid). A warp's rows take the leftover in part (m + n) mod 4:
    over 4 rounds every part once when ncb is odd (ops.kv9_odd_groups), but only 2 of the 4 parts
    for ncb = 66 (the even count the grid would give), as for any even count."""
    NP = 4
    for ncb in (65, 61, 67):
        for cb in range(ncb):
            parts = sorted((cb + r * ncb) % NP for r in range(NP))
            assert parts == [0, 1, 2, 3], (ncb, cb)
    for ncb in (66, 64, 62):
        assert all(len({(cb + r * ncb) % NP for r in range(NP)}) <= 2 for cb in range(ncb))

