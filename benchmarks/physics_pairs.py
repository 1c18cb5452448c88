"""How close the realised-gain model comes to published before/after measurements, by the knob each pair changes.

Reads the physics corpus (tests/fixtures/published/results.json) through tests/test_physics_published.py's own
predictions, groups the pairs by what differs between baseline and row (batch, weights' precision, KV precision,
tensor parallelism, GPU, context; several at once named together), and prints, per knob, how many lie within 25 %
and 20 % of what was measured, the mean error and the worst misses. benchmarks/PHYSICS.md holds its output.
`--fixed-overhead` prints the same for the model before issue 44 item 2 (the time beyond the roofline held fixed
per decode step, nothing of it growing with the batch).

    python benchmarks/physics_pairs.py [--fixed-overhead]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_physics_published import DATA, ROWS, Pair, predict

KNOBS = (("batch", "batch"), ("dtype", "precision"), ("kv_dtype", "KV precision"), ("tp", "TP"), ("gpu", "GPU"),
         ("context", "context"), ("input_tokens", "prompt"), ("output_tokens", "output"))


def knob(pair: Pair) -> str:
    base, row = ROWS[pair.baseline], ROWS[pair.row]
    changed = [name for key, name in KNOBS if base.get(key) != row.get(key)]
    return " + ".join(changed) or "none"


def main(per_sequence: bool = True) -> None:
    groups: dict[str, list[Pair]] = defaultdict(list)
    for comparison in DATA["comparisons"]:
        for other in comparison["rows"]:
            pair = predict(comparison["baseline"], other, per_sequence=per_sequence)
            if pair.efficiency is not None:  # a capacity bound has no realised gain
                groups[knob(pair)].append(pair)
    print("| knob | pairs | within 25 % | within 20 % | mean error | worst misses (predicted / measured - 1) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, pairs in sorted(groups.items(), key=lambda item: -len(item[1])):
        within = [sum(abs(p.error) <= bound for p in pairs) for bound in (0.25, 0.20)]
        mean = sum(abs(p.error) for p in pairs) / len(pairs)
        worst = sorted(pairs, key=lambda p: -abs(p.error))[:3]
        named = "; ".join(f"{p.baseline} -> {p.row} {p.error:+.0%}" for p in worst if abs(p.error) > 0.20)
        print(f"| {name} | {len(pairs)} | {within[0]} | {within[1]} | {mean:.1%} | {named or '-'} |")


if __name__ == "__main__":
    main(per_sequence="--fixed-overhead" not in sys.argv[1:])
