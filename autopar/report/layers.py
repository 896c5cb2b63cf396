"""Roll a plan up by module path, showing repeated blocks once with a count.

Every node decision and parameter belongs to a module path (`transformer.h.3.attn.c_attn`).
Paths that differ only in their first numeric index (the block number) and have
identical decisions are merged into one row, `transformer.h.0..11.attn.c_attn` x12;
a block that was planned differently breaks the run and gets its own row, so
nothing is hidden by the roll-up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from autopar.report.words import activation_words, param_words, placement_kind
from autopar.solver.plan import Plan
from autopar.solver.spec import Shard, Spec

_NOT_OPS = ("placeholder", "output", "get_attr")
TOP_LEVEL = "(top level)"


@dataclass(frozen=True)
class LayerRow:
    module: str  # path with the block range collapsed: "transformer.h.0..11.mlp.c_fc"
    count: int  # how many blocks share this row
    params: str  # parameters in words; "weight, bias: column-parallel over tp" ...
    output: str  # the module's output activation in words
    recompute: str  # "no", "all", or "3 of 7 ops"
    kind: str  # colour class: replicated / data / tensor / partial
    ops: int  # ops per block
    members: tuple[str, ...] = field(default=(), compare=False)  # the real module paths merged into this row


@dataclass
class _Entry:
    path: str
    order: int
    params: list[tuple[str, str]] = field(default_factory=list)  # (leaf name, words)
    specs: list[Spec] = field(default_factory=list)  # use specs of params, for the colour class
    last_out: Spec | None = None
    ops: int = 0
    recomputed: int = 0

    def signature(self) -> tuple:
        return (tuple(self.params), str(self.last_out), self.ops, self.recomputed)


def split_block(path: str) -> tuple[str, int | None, str]:
    """'transformer.h.3.attn' -> ('transformer.h.', 3, '.attn'); no numeric segment -> (path, None, '')."""
    m = re.search(r"(^|\.)(\d+)(\.|$)", path)
    if m is None:
        return path, None, ""
    return path[: m.start(2)], int(m.group(2)), path[m.end(2):]


def _params_text(params: list[tuple[str, str]]) -> str:
    by_words: dict[str, list[str]] = {}
    for leaf, words in params:
        by_words.setdefault(words, []).append(leaf)
    if len(by_words) == 1:
        return next(iter(by_words))
    return "; ".join(f"{', '.join(leaves)}: {words}" for words, leaves in by_words.items())


def _kind(entry: _Entry) -> str:
    """Tensor parallel when it splits a parameter (a parameter has no batch dim: any split of one is); else what
    its output is (`placement_kind`): split by batch only, partial sums, replicated or split otherwise."""
    if any(isinstance(p, Shard) for s in entry.specs for p in s.placements):
        return "tensor"
    return placement_kind(entry.last_out) if entry.last_out is not None else "replicated"


def _entries(plan: Plan) -> list[_Entry]:
    axis_names = plan.mesh.axis_names
    ndims = {fqn: len(shape) for fqn, shape in plan.fingerprint.param_shapes}
    entries: dict[str, _Entry] = {}

    def entry(path: str) -> _Entry:
        path = path or TOP_LEVEL
        if path not in entries:
            entries[path] = _Entry(path, len(entries))
        return entries[path]

    # Ops first, so rows follow the forward order; parameters (placeholders, listed first in the graph) join their module.
    for d in plan.nodes:
        if d.op in _NOT_OPS:
            continue
        e = entry(d.module)
        e.ops += 1
        e.recomputed += d.recompute
        if d.strategy.output_specs and d.strategy.output_specs[0] is not None:
            e.last_out = d.strategy.output_specs[0]
    for p in plan.params:
        module, _, leaf = p.fqn.rpartition(".")
        e = entry(module)
        e.params.append((leaf, param_words(p, axis_names, ndims.get(p.fqn))))
        e.specs.append(p.use)
    return sorted(entries.values(), key=lambda e: e.order)


def rollup(plan: Plan) -> tuple[LayerRow, ...]:
    """One row per module path, consecutive identical blocks merged (see module docstring)."""
    axis_names = plan.mesh.axis_names
    groups: dict[tuple[str, str], list[tuple[int, _Entry]]] = {}
    singles: list[_Entry] = []
    for e in _entries(plan):
        prefix, idx, rest = split_block(e.path)
        if idx is None:
            singles.append(e)
        else:
            groups.setdefault((prefix, rest), []).append((idx, e))
    runs: list[tuple[int, str, list[_Entry]]] = [(e.order, e.path, [e]) for e in singles]
    for (prefix, rest), members in groups.items():
        members.sort(key=lambda t: t[0])
        run: list[tuple[int, _Entry]] = []
        for idx, e in members:
            if run and (idx != run[-1][0] + 1 or e.signature() != run[-1][1].signature()):
                runs.append(_run(prefix, rest, run))
                run = []
            run.append((idx, e))
        runs.append(_run(prefix, rest, run))
    rows = []
    for _order, name, es in sorted(runs, key=lambda r: r[0]):
        e = es[0]
        if e.ops == 0 and not e.params:
            continue
        recompute = "no" if e.recomputed == 0 else "all" if e.recomputed == e.ops else f"{e.recomputed} of {e.ops} ops"
        rows.append(LayerRow(name, len(es), _params_text(e.params) if e.params else "-", activation_words(e.last_out, axis_names), recompute, _kind(e), e.ops, tuple(x.path for x in es)))
    return tuple(rows)


def _run(prefix: str, rest: str, run: list[tuple[int, "_Entry"]]) -> tuple[int, str, list[_Entry]]:
    first, last = run[0][0], run[-1][0]
    label = f"{prefix}{first}{rest}" if first == last else f"{prefix}{first}..{last}{rest}"
    return (run[0][1].order, label, [e for _, e in run])
