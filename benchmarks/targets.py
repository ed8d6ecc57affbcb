"""The targets of the benchmark issue, read from a ``ctrlcomm bench --json`` file.

``python benchmarks/targets.py RUN.json`` prints, as a markdown table, each target's ratio per
world size (for the four small ops: barrier, all_reduce of two ints, broadcast and all_gather
of a small dict), in brackets in how many of the run's turns (``--repeat``) it held, in bold
where the run's ratio misses; then how many ratios miss. The ratios are of medians (per
iteration the slowest rank's time, ``median_us``), as the issue states them:

- another system over ctrlcomm: gloo >= 3; the store >= 2 at world 2, >= 3 above; Megatron's
  star >= 1 (all_reduce); a 1 MiB broadcast, gloo >= 1;
- the awaited variant over the blocking one <= 1.5;
- world 2, blocking CPU per call over the median latency <= 0.7 (in parentheses: over the
  same calls' wall time, ``cpu_frac``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

SMALL = [("barrier", 0), ("all_reduce", 8), ("broadcast", 8), ("all_gather", 8)]


def _index(results: list[dict[str, Any]]) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    return {(r["system"], r["op"], r["size"], r["world_size"]): r for r in results}


def _ratio(num: dict[str, Any], den: dict[str, Any], ok: Any) -> tuple[float, int, int, bool]:
    """num/den of medians, the turns where ok(turn ratio), the turns, ok(ratio)."""
    value = num["median_us"] / den["median_us"]
    turns = list(zip(num.get("repeat_median_us", []), den.get("repeat_median_us", []),
                     strict=False))  # (a run of one turn gives none)
    held = sum(1 for a, b in turns if ok(a / b))
    return value, held, len(turns), ok(value)


def _cell(r: tuple[float, int, int, bool] | None) -> str:
    if r is None:
        return "-"
    value, held, n, ok = r
    text = f"{value:.2f} [{held}]" if n else f"{value:.2f}"
    return text if ok else f"**{text}**"


def targets(run: dict[str, Any]) -> tuple[str, int]:
    """The markdown table of ``run``'s targets, and how many ratios miss."""
    by = _index(run["results"])
    worlds = [w for w in run["config"]["world_sizes"] if w > 1]
    rows: list[tuple[str, dict[int, list[tuple[float, int, int, bool] | None]]]] = []

    def vs(system: str, need: Any, ops: list[tuple[str, int]], invert: bool = False
           ) -> dict[int, list[tuple[float, int, int, bool] | None]]:
        out: dict[int, list[tuple[float, int, int, bool] | None]] = {}
        for n in worlds:
            cells: list[tuple[float, int, int, bool] | None] = []
            for op, size in ops:
                mine = by.get(("ctrlcomm", op, size, n))
                other = by.get((system, op, size, n))
                if mine is None or other is None:
                    cells.append(None)
                    continue
                lim = need(n)
                if invert:  # (the awaited variant: its median over ctrlcomm's, at most lim)
                    cells.append(_ratio(other, mine, lambda x, lim=lim: x <= lim))
                else:
                    cells.append(_ratio(other, mine, lambda x, lim=lim: x >= lim))
            out[n] = cells
        return out

    rows.append(("gloo >= 3x", vs("gloo", lambda n: 3.0, SMALL)))
    rows.append(("store >= 2x (w2) / 3x", vs("store", lambda n: 2.0 if n == 2 else 3.0, SMALL)))
    rows.append(("star / ctrlcomm >= 1 (all_reduce)", vs("star", lambda n: 1.0, SMALL[1:2])))
    rows.append(("awaited <= 1.5x blocking", vs("ctrlcomm-aio", lambda n: 1.5, SMALL,
                                                 invert=True)))
    cpu: dict[int, list[tuple[float, int, int, bool] | None]] = {}
    cpu_frac: dict[int, list[float | None]] = {}
    for n in worlds[:1] if worlds and worlds[0] == 2 else []:
        cpu[n], cpu_frac[n] = [], []
        for op, size in SMALL:
            r = by.get(("ctrlcomm", op, size, n))
            if r is None:
                cpu[n].append(None)
                cpu_frac[n].append(None)
                continue
            v = r["cpu_us"] / r["median_us"]
            cpu[n].append((v, 0, 0, v <= 0.7))
            cpu_frac[n].append(r["cpu_frac"])
    rows.append(("CPU <= 0.7 x latency, w2 (in parentheses: CPU / the same calls' wall time)",
                 cpu))
    rows.append(("1 MiB broadcast: gloo / ctrlcomm >= 1",
                 vs("gloo", lambda n: 1.0, [("broadcast", 1 << 20)])))

    lines = ["| target | " + " | ".join(f"w{n}" for n in worlds) + " |",
             "|---|" + "---|" * len(worlds)]
    missed = 0
    for name, per in rows:
        cells = []
        for n in worlds:
            got = per.get(n)
            if not got:
                cells.append("")
                continue
            missed += sum(1 for c in got if c is not None and not c[3])
            if name.startswith("CPU"):
                cells.append(", ".join(f"{_cell(c)} ({f:.2f})" if c and f is not None else "-"
                                       for c, f in zip(got, cpu_frac[n], strict=True)))
            else:
                cells.append(", ".join(_cell(c) for c in got))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), missed


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            text, missed = targets(json.load(f))
        print(f"{path}:\n\n{text}\n\n{missed} ratios miss\n")


if __name__ == "__main__":
    main()
