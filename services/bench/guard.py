"""`memories bench guard`: what each write policy decides on the labelled fact pairs, with the default
embedder. Prints a confusion table per policy (and, with --pairs, every pair's score and decisions).

The pairs live in tests/data/fact_pairs.jsonl: copies, trivial edits, paraphrases, reversals, negations,
value updates, related and unrelated facts. For each pair the existing fact is the memory's nearest entry
and the incoming fact is written with duplicate_threshold 0.95; no model is involved (no agent context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path

from shared.decision import Candidate, IncomingWrite, decide
from shared.embeddings import cosine, embed_texts
from shared.events import DEFAULT_DUPLICATE_THRESHOLD, WritePolicy
from shared.guard import content_hash
from shared.settings import get_settings

PAIRS = Path(__file__).resolve().parents[2] / "tests" / "data" / "fact_pairs.jsonl"
SAME = ("copy", "trivial_edit")
CONTRADICTIONS = ("reversal", "negation", "value_update")
POLICIES = (WritePolicy.SEED, WritePolicy.GUARDED)


async def _decisions(pairs: list[dict[str, str]], threshold: float) -> list[dict[str, object]]:
    settings = get_settings()
    texts = [text for pair in pairs for text in (pair["existing"], pair["incoming"])]
    vectors = await embed_texts(texts, model=settings.embedding_model, dimensions=settings.embedding_dimensions)
    rows = []
    for i, pair in enumerate(pairs):
        score = cosine(vectors[2 * i], vectors[2 * i + 1])
        existing = Candidate("mem_entry_existing0000", pair["existing"], score)
        exact = existing if content_hash(pair["existing"]) == content_hash(pair["incoming"]) else None
        row: dict[str, object] = {**pair, "score": score}
        for policy in POLICIES:
            decision = await decide(
                IncomingWrite(pair["incoming"], threshold, policy), exact_match=exact, nearest=[existing]
            )
            row[policy.value] = (decision.action.value, decision.rule)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, object]]) -> str:
    kinds = sorted({str(r["kind"]) for r in rows}, key=lambda k: (k not in SAME, k not in CONTRADICTIONS, k))
    header = f"{'kind':<14}{'pairs':>6}{'score≥0.95':>12}" + "".join(f"{p.value + ' skips':>15}" for p in POLICIES)
    lines = [header, "-" * len(header)]
    for kind in kinds:
        subset = [r for r in rows if r["kind"] == kind]
        near = sum(1 for r in subset if float(r["score"]) >= DEFAULT_DUPLICATE_THRESHOLD)  # type: ignore[arg-type]
        skips = [sum(1 for r in subset if r[p.value][0] == "skipped") for p in POLICIES]  # type: ignore[index]
        lines.append(f"{kind:<14}{len(subset):>6}{near:>12}" + "".join(f"{s:>15}" for s in skips))
    return "\n".join(lines)


def _summary(rows: list[dict[str, object]]) -> str:
    lines = []
    for policy in POLICIES:
        same = [r for r in rows if r["kind"] in SAME]
        skipped_same = sum(1 for r in same if r[policy.value][0] == "skipped")  # type: ignore[index]
        silent = [r for r in rows if r["kind"] in CONTRADICTIONS and r[policy.value][0] == "skipped"]  # type: ignore[index]
        lines.append(
            f"{policy.value:>8}: copies and trivial edits skipped {skipped_same}/{len(same)} "
            f"({100 * skipped_same / max(len(same), 1):.0f} %), contradictions silently skipped {len(silent)}"
        )
    kept = [
        r for r in rows
        if r["kind"] in (*SAME, "paraphrase")
        and r["seed"][0] == "skipped" and r["guarded"][0] != "skipped"  # type: ignore[index]
    ]
    lines.append(f"cost of guarded: {len(kept)} near-copies kept that seed would skip")
    fired = Counter(str(r["guarded"][1]) for r in rows if str(r["guarded"][1]).startswith("guard:"))  # type: ignore[index]
    lines.append("guard rules fired: " + ", ".join(f"{rule} {n}" for rule, n in sorted(fired.items())))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memories bench guard", description=__doc__)
    parser.add_argument("--pairs", action="store_true", help="also print every pair's score and decisions")
    parser.add_argument("--threshold", type=float, default=DEFAULT_DUPLICATE_THRESHOLD)
    args = parser.parse_args(argv)
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    rows = asyncio.run(_decisions(pairs, args.threshold))
    print(f"{len(pairs)} labelled pairs, embedder {get_settings().embedding_model}, threshold {args.threshold}\n")
    if args.pairs:
        for r in rows:
            decisions = "  ".join(f"{p.value}={r[p.value][0]}({r[p.value][1]})" for p in POLICIES)  # type: ignore[index]
            print(f"{float(r['score']):.3f}  {r['kind']:<13} {decisions}\n       {r['existing']!r} -> {r['incoming']!r}")  # type: ignore[arg-type]
        print()
    print(_table(rows))
    print()
    print(_summary(rows))
    return 0
