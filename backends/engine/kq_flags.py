"""Readiness counts between a SwiGLU pair and its ffn_down (GGUF_HARNESS_GEMV_KQ_FLAGS=1,
kernels/gemv_kq.cu KQ_FLAGS): link() finds each producer / consumer pair of a decode step and fills
their tables' flag records.

A pair: a v9 SwiGLU node of the queue build (KQ_DQ=1, an entry gemvkq_swiglu_<type> whose rows come
from the queue; the 27B's gate/up) immediately followed by a
4-part group node (a `_c4` kernel of the KQ_GSPLIT build; ffn_down) that reads the pair's output as
its x. The producer counts its stored rows per 1024-row group into a u32 array (`counts`, 32
words: groups 0..ng-1, word 30 protocol errors, word 31 the consumer's blocks past their wait),
taking its rows in the order the consumer's parts need them; the consumer waits on its part's
groups instead of on the producer's whole grid, checks every count is exactly 1024 and resets them.
A consumer whose counts do not come within 1 s stops waiting; that and a wrong count raise word 30,
which the engine checks after each step (backend.py: NumericError). Both nodes must be of the
KQ_FLAGS build and the consumer's K a multiple of 1024 with 4 <= K / 1024 <= 30 (the kernel's group
arithmetic), the
producer's rows equal to it. Anything else stays unlinked (role 0: the plain PDL wait), so a
kernel benchmark or trace of one node alone never waits on counts nobody writes.
"""
from __future__ import annotations

import re

import numpy as np

from . import ops

GROUP = 1024   # kernels/gemv_kq.cu kFlagGroup: values of 4 super-blocks, a consumer part's unit
MAX_GROUPS = 30  # count words 0..29 (gemv_kq.cu kFlagMaxGroups)
ERR, SEEN = 30, 31  # word 30: protocol errors (kFlagErr), word 31: consumer blocks past their wait
WORDS = 32
PRODUCER, CONSUMER = 1, 2
# the SwiGLU entries whose rows come from the queue (gemv_kq.cu kq_body -> kq_dq_body: one row per
# warp, 8 lanes, no S-split), the only ones that count
_QUEUE_PAIR = re.compile(r"^gemvkq_swiglu_[a-z0-9_]+(?<!_s2)(?<!_s4)$")


def _has_flags(node) -> bool:
    return "KQ_FLAGS=1" in getattr(node, "defines", ())


def _name(node) -> str:
    return str(getattr(node.kernel, "name", ""))


def pair_groups(producer, consumer) -> int:
    """The consumer's 1024-row groups when (producer, consumer) is a pair link() takes (see the
    module docstring), else 0."""
    if not (_has_flags(producer) and _has_flags(consumer)):
        return 0
    if not ("KQ_DQ=1" in producer.defines and _QUEUE_PAIR.match(_name(producer))):
        return 0
    if not ("KQ_GSPLIT=1" in consumer.defines and _name(consumer).endswith("_c4")):
        return 0
    x, K = consumer.args[1], int(consumer.args[4])
    if producer.out is None or x is None or int(x.data.ptr) != int(producer.out.data.ptr):
        return 0
    rows = int(producer.args[5])
    if K % GROUP or rows != K or not 4 <= K // GROUP <= MAX_GROUPS:
        return 0
    return K // GROUP


def _with_flags(table, flags):
    """A copy of the by-value table `table` (a numpy structured scalar) with its flag record set to
    `flags`; the original is left as it was (np.array of such a scalar shares its memory, hence
    the copy)."""
    new = np.array(table).copy()
    new["flags"] = flags
    return new[()]


def link(nodes: list, counts) -> int:
    """Fill the flag records of every producer / consumer pair among consecutive `nodes` (the step
    in order), with `counts` (a zeroed device u32 array of at least 32 words, kept alive by the
    caller) as their count array. Returns the pairs linked. A linked node's cached PDL launch is
    dropped (it relaunches with the new table). Raises ValueError if `counts` is too small."""
    if counts.size < WORDS or counts.dtype != np.uint32:
        raise ValueError(f"readiness counts: need a uint32 array of {WORDS} words, got "
                         f"{counts.dtype} [{counts.size}]")
    linked = 0
    for a, b in zip(nodes, nodes[1:]):
        ng = pair_groups(a, b)
        if not ng:
            continue
        for node, role in ((a, PRODUCER), (b, CONSUMER)):
            node.args = (_with_flags(node.args[0], (int(counts.data.ptr), ng, ng // 4, role, 0)),) \
                + tuple(node.args[1:])
            node._pdl = None
        linked += 1
    return linked


def linked(node) -> bool:
    """The node's table has a flag record with a role (link() set it)."""
    table = node.args[0] if node.args else None
    names = getattr(getattr(table, "dtype", None), "names", None) or ()
    return "flags" in names and int(table["flags"]["role"]) != 0


def unlinked(node):
    """`node` itself when not linked, else a copy whose table has role 0 (the plain PDL wait, no
    counting): what a node timed or run alone must be, as no partner then moves the counts (a
    consumer alone would wait forever, a producer alone would leave counts behind)."""
    if not linked(node):
        return node
    import dataclasses
    return dataclasses.replace(node, args=(_with_flags(node.args[0], 0),) + tuple(node.args[1:]))


def enabled() -> bool:
    """GGUF_HARNESS_GEMV_KQ_FLAGS is 1 (ops.kv9_defines refuses other values than 0 / 1 / "")."""
    return ops.GEMV_KQ_FLAGS == "1"
