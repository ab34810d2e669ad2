"""Count the collective communication in compiled XLA programs, from their HLO text.

Used by the strategy planner's tests and the context-parallel benchmark to compare predicted
and compiled communication.
"""

import math
import re
from typing import Any, NamedTuple

COLLECTIVES: tuple[str, ...] = (
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "all-reduce",
)

# ---- counting collectives in compiled HLO --------------------------------------------------


class Collective(NamedTuple):
    """One collective instruction of a compiled program."""

    op: str  # e.g. "all-gather" (a "-start" form is reported under its base name)
    result_bytes: int  # bytes of the result on one device
    group: int  # devices taking part (replica group size)
    count: int  # times it runs (product of enclosing known while-loop trip counts)
    bytes: float  # received per device, all runs (see the module docstring)


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\("
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(
    r"(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def collectives(compiled: Any) -> list[Collective]:
    """Every collective in `compiled` (a `jax.stages.Compiled` or its `as_text()`).

    Instructions inside a `while` body count once per known trip count; a `conditional`'s
    branches count as if each ran (an upper bound; the strategies put no collective there).
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    parts = re.search(r"num_partitions=(\d+)", text)
    n_devices = int(parts.group(1)) if parts else 1
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for kind, callee in _CALLEE.findall(line):
                times = int(trip.group(1)) if (kind == "body" and trip) else 1
                callers.setdefault(callee, []).append((name, times))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    callers.setdefault(callee, []).append((name, 1))
    memo: dict[str, int] = {}

    def runs(name: str) -> int:
        if name == entry:
            return 1
        if name not in memo:
            memo[name] = 0  # guards against cycles in malformed text
            memo[name] = sum(runs(c) * t for c, t in callers.get(name, []))
        return memo[name]

    found = []
    for name, lines in comps.items():
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            op, result = m.group(2), re.sub(r"/\*.*?\*/", "", m.group(1))
            if m.group(3):  # async start: (operands, results[, context]) -> the results
                result = _tuple_items(result)[1]
            size = sum(
                _DTYPE_BYTES.get(dt, 4) * math.prod(int(x) for x in dims.split(",") if x)
                for dt, dims in _SHAPE.findall(result)
            )
            group = _group_size(op, line, n_devices)
            count = runs(name)
            found.append(Collective(op, size, group, count, count * _received(op, size, group)))
    return found


def collective_bytes(compiled: Any) -> dict[str, int]:
    """Bytes received per device by collective kind, over one run of `compiled`.

    Parses `compiled.as_text()` (or the text itself) for all-gather, all-to-all,
    collective-permute, reduce-scatter and all-reduce, and their `-start` forms. An
    instruction inside a `while` body counts once per known trip count; a `conditional`'s
    branches count as if each ran (an upper bound). Each instruction counts the bytes one
    device receives: `(n - 1) / n` of its result for an all-gather or all-to-all over `n`
    devices, `n - 1` results for a reduce-scatter, `2 (n - 1) / n` for an all-reduce, the
    whole result for a collective-permute.

    **Arguments:**

    - `compiled`: a `jax.stages.Compiled` (from `jax.jit(f).lower(...).compile()`) or its
      `as_text()`.

    **Returns:** bytes per device for each kind in `COLLECTIVES` (`"all-gather"`,
    `"all-to-all"`, `"collective-permute"`, `"reduce-scatter"`, `"all-reduce"`), 0 for a
    kind the program does not use.
    """
    out = dict.fromkeys(COLLECTIVES, 0)
    for c in collectives(compiled):
        out[c.op] += int(round(c.bytes))
    return out


def _tuple_items(text: str) -> list[str]:
    text = text.strip()
    if not text.startswith("("):
        return [text, text]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            items.append(text[start:i])
            start = i + 1
    return items if len(items) > 1 else [text, text]


def _group_size(op: str, line: str, n_devices: int) -> int:
    if op == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[-1])
        moved = {int(a) for a, t in pairs if a != t}
        return len(moved) if moved else 1
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # iota form [groups,size]<=[...]
    if m:
        return int(m.group(2))
    # mesh form (newer XLA): replica_groups=mesh['data'=2,'context'=4] {'context'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes[axis] for axis in re.findall(r"'([^']+)'", m.group(2)))
    return n_devices  # empty replica_groups: every device


def _received(op: str, size: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if op == "collective-permute":
        return float(size)
    if op == "reduce-scatter":
        return float(size * (n - 1))
    if op == "all-reduce":
        return 2.0 * size * (n - 1) / n
    return size * (n - 1) / n
