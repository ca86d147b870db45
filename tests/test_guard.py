"""shared.guard: the cheap rules that keep dedup from skipping contradictions."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from shared.guard import content_hash, meaning_change, normalize_content

PAIRS_FILE = Path(__file__).parent / "data" / "fact_pairs.jsonl"
KINDS = {"copy", "trivial_edit", "paraphrase", "reversal", "negation", "value_update", "related", "unrelated"}
CONTRADICTIONS = {"reversal", "negation", "value_update"}
SAME_TEXT = {"copy", "trivial_edit"}


def _load_pairs() -> list[dict]:
    with PAIRS_FILE.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


PAIRS = _load_pairs()

# (existing, incoming, expected rule)
TABLE: list[tuple[str, str, str | None]] = [
    # None: copies, surface edits and paraphrase noise.
    ("Alice is allergic to peanuts.", "Alice is allergic to peanuts.", None),
    ("Alice is allergic to peanuts.", "alice is ALLERGIC to peanuts!!", None),
    ("Bob doesn't drink coffee.", "Bob does not drink coffee.", None),
    ("Bob won't travel in May.", "Bob will not travel in May.", None),
    ("Carol can't attend on Fridays.", "Carol cannot attend on Fridays.", None),
    ("The budget is 40,000.", "The budget is 40000.", None),
    ("The budget is $40k.", "The budget is 40 thousand dollars.", None),
    ("Stand-up is at 3pm.", "Stand-up is at 15:00.", None),
    ("The office is on the 3rd floor.", "The office is on the third floor.", None),
    ("The app uses API v2.", "The app uses API version 2.", None),
    ("The team really likes the new CI pipeline.", "The team likes the new CI pipeline.", None),
    ("Alice and Bob own billing.", "Bob and Alice own billing.", None),
    ("In May, Dana moved to Lisbon.", "Dana moved to Lisbon in May.", None),
    ("Dana is unhappy with support.", "Dana is not happy with support.", None),
    ("Eats neither fish nor meat.", "Does not eat fish or meat.", None),
    ("Prefers tea to coffee.", "Prefers tea over coffee.", None),
    # negation
    ("Alice is allergic to peanuts.", "Alice is not allergic to peanuts.", "negation"),
    ("Bob is happy with the plan.", "Bob is unhappy with the plan.", "negation"),
    ("Dana likes cold calls.", "Dana dislikes cold calls.", "negation"),
    ("Cat food is allergenic.", "Cat food is non-allergenic.", "negation"),
    ("Eric has pets.", "Eric has no pets.", "negation"),
    ("The SLA is binding.", "The SLA isn't binding.", "negation"),
    ("Fay answers on weekends.", "Fay never answers on weekends.", "negation"),
    ("Has no allergies and never eats meat.", "Has allergies and never eats meat.", "negation"),
    # value
    ("The budget is 40,000.", "The budget is 65,000.", "value"),
    ("Call her at 3pm.", "Call her at 4pm.", "value"),
    ("Renewal date is 2024-05-01.", "Renewal date is 2024-06-01.", "value"),
    ("Client SDK is v2.", "Client SDK is v3.", "value"),
    ("Runs on Python 3.10.", "Runs on Python 3.1.", "value"),
    ("Gus lives in Berlin.", "Gus lives in Munich.", "value"),
    ("Gus lives in berlin.", "Gus lives in Munich.", "value"),
    ("The team has five engineers.", "The team has six engineers.", "value"),
    ("The retro is on the second Monday.", "The retro is on the first Monday.", "value"),
    ("Launch is planned for March.", "Launch is planned for April.", "value"),
    # order
    ("Prefers email over phone calls.", "Prefers phone calls over email.", "order"),
    ("Alice manages Bob.", "Bob manages Alice.", "order"),
    ("Migrate billing before search.", "Migrate search before billing.", "order"),
    ("Helen earns more than Ian.", "Ian earns more than Helen.", "order"),
    # A number in words is the same number: a paraphrase, not a changed value.
    ("We handle 100 requests per second.", "We handle one hundred requests per second.", None),
    ("We handle 100 requests per second.", "We handle two hundred requests per second.", "value"),
    ("The budget is 5 hundred dollars.", "The budget is 500 dollars.", None),
    ("We serve 100 users.", "We serve one hundred thousand users.", "value"),  # every multiplier counts
    ("It costs 500 dollars.", "It costs 5 hundred thousand dollars.", "value"),
    # A phrase holding one value moved elsewhere is a paraphrase; so is a value spelt out beside new names.
    ("Standup is at 9am every Monday.", "Every Monday at 9am there is a standup.", None),
    ("Alice was born on 1990-04-12 in Paris.", "In Paris, on 1990-04-12, Alice was born.", None),
    ("Alice has 2 kids.", "Alice has two kids, Ben and Cara.", None),
    # The same values, swapped between the words they go with.
    ("Server A has 16 GB RAM and 4 CPUs.", "Server A has 4 GB RAM and 16 CPUs.", "value"),  # 16 GB is not 16
    ("Tom is 30 and Ann is 25.", "Tom is 25 and Ann is 30.", "order"),
    ("The call moved from 3pm to 4pm.", "The call moved from 4pm to 3pm.", "order"),
    ("Version 2 replaced version 3.", "Version 3 replaced version 2.", "order"),
    ("The review moved from 2024-03-01 to 2024-04-01.", "The review moved from 2024-04-01 to 2024-03-01.", "order"),
    ("Server A has 16 GB RAM and 4 CPUs.", "Server A has 16 GB of RAM and 4 CPUs", None),
    # A unit written apart or not is the same value; another unit is another value.
    ("The server has 16 GB RAM and 4 CPUs.", "The server has 16GB RAM and 4 CPUs.", None),
    ("The parcel weighs 2 kg.", "The parcel weighs 2kg.", None),
    ("The file is 1.5 MB.", "The file is 1.5MB.", None),
    ("The parcel weighs 2 kg.", "The parcel weighs 2 lb.", "value"),
    ("The parcel weighs 2 lbs.", "The parcel weighs 2lb.", None),
    ("The API quota is 10\u2076 requests per day.", "The API quota is 106 requests per day.", "value"),
    ("Add \u00bd cup of sugar.", "Add \u00bc cup of sugar.", "value"),
    ("The flat is 20 m\u00b2.", "The flat is 20 m\u00b3.", "value"),
    ("Add \u00bd cup of sugar.", "Add 1/2 cup of sugar.", None),
    ("The parcel weighs 2kg.", "The parcel weighs 2 lb.", "value"),
]

# Contradictions the cheap rules do not see (would need a lexicon or a parser). Each scored
# below the 0.95 duplicate threshold with all-MiniLM-L6-v2 (0.86-0.94), so dedup keeps them,
# but nothing here guarantees that. strict: if one starts passing, move it to TABLE.
KNOWN_GAPS: list[tuple[str, str]] = [
    ("Alice likes tea.", "Alice hates tea."),  # antonym, no negation marker
    ("Alice eats meat.", "Alice stopped eating meat."),  # change of state verb
    ("Alice manages Bob.", "Alice is managed by Bob."),  # passive reversal
    ("Alice moved to Berlin.", "Bob moved to Berlin."),  # sentence-initial names are not told from words
    ("The budget is €40,000.", "The budget is $40,000."),  # currency symbols are ignored
]


@pytest.mark.parametrize(("existing", "incoming", "expected"), TABLE)
def test_table(existing: str, incoming: str, expected: str | None) -> None:
    assert meaning_change(existing, incoming) == expected
    # The writer may see either side first; whether a rule fires must not depend on it.
    assert (meaning_change(incoming, existing) is None) == (expected is None)


@pytest.mark.parametrize(("existing", "incoming"), KNOWN_GAPS)
@pytest.mark.xfail(strict=True, reason="known gap of the cheap rules")
def test_known_gaps(existing: str, incoming: str) -> None:
    assert meaning_change(existing, incoming) is not None


def test_normalize_content() -> None:
    assert normalize_content("  Alice\tLIKES \n tea.  ") == "alice likes tea"
    assert normalize_content('"Alice likes tea!"') == "alice likes tea"
    assert normalize_content("Alice likes tea?!;:") == "alice likes tea"
    assert normalize_content("Ships to London , UK .") == "ships to london, uk"
    assert normalize_content("Maria doesn\u2019t eat pork") == "maria doesn't eat pork"
    assert normalize_content("\uff21lice") == "alice"  # NFKC: fullwidth A
    assert normalize_content("Stra\u00dfe") == normalize_content("STRASSE")  # casefold, not lower
    assert normalize_content('Alice likes "tea".') == 'alice likes "tea"'  # inner quotes stay
    assert normalize_content("v3.11.") == "v3.11"
    # Compatibility forms that change a number are kept: not the text's spelling, its meaning.
    for kept, plain in [("10\u2076 requests", "106 requests"), ("Tier \u00b9 support", "Tier 1 support"),
                        ("H\u2082O", "H2O")]:
        assert normalize_content(kept) != normalize_content(plain), kept
    assert normalize_content("\uff21lice has 10\u2076") == normalize_content("Alice has 10\u2076")  # NFKC elsewhere


def test_content_hash() -> None:
    h = content_hash("Alice likes tea.")
    assert len(h) == 64 and int(h, 16) >= 0
    for same in ("alice likes tea", "  ALICE   likes tea!  ", '"Alice likes tea."', "Alice likes tea..."):
        assert content_hash(same) == h
    for other in ("Alice likes teas.", "Alice likes green tea.", "Alice likes tea 2.", "Alice likes tee."):
        assert content_hash(other) != h
    assert content_hash("Budget is 40,000") != content_hash("Budget is 40,001")


def test_pairs_file_shape() -> None:
    counts = Counter(p["kind"] for p in PAIRS)
    assert len(PAIRS) >= 70
    assert set(counts) == KINDS and min(counts.values()) >= 8, counts
    for p in PAIRS:
        assert set(p) == {"existing", "incoming", "kind", "expected_rule"}, p
        assert p["expected_rule"] in (None, "negation", "value", "order"), p
        assert (p["expected_rule"] is not None) == (p["kind"] in CONTRADICTIONS), p
        if p["kind"] == "copy":
            assert p["existing"] == p["incoming"], p


def test_no_contradiction_slips_through() -> None:
    missed = [
        p
        for p in PAIRS
        if p["kind"] in CONTRADICTIONS and meaning_change(p["existing"], p["incoming"]) is None
    ]
    assert missed == []


def test_contradictions_fire_the_expected_rule() -> None:
    wrong = [
        (p, got)
        for p in PAIRS
        if p["kind"] in CONTRADICTIONS
        if (got := meaning_change(p["existing"], p["incoming"])) != p["expected_rule"]
    ]
    assert wrong == []


def test_copies_and_trivial_edits_are_the_same_fact() -> None:
    for p in PAIRS:
        if p["kind"] in SAME_TEXT:
            assert meaning_change(p["existing"], p["incoming"]) is None, p
            assert content_hash(p["existing"]) == content_hash(p["incoming"]), p


def test_symmetric_on_pairs() -> None:
    for p in PAIRS:
        forward, backward = (
            meaning_change(p["existing"], p["incoming"]),
            meaning_change(p["incoming"], p["existing"]),
        )
        assert (forward is None) == (backward is None), p


# Paraphrases the cheap rules cannot tell from a change of meaning: a negation word with no negated meaning, a
# date written two ways. `guarded` stores each of them again rather than skipping it (the policy's cost).
PARAPHRASES_A_RULE_FIRES_ON = {
    ("Customer is vegetarian.", "The customer does not eat meat."),
    ("Invoice is due on 2024-05-01.", "Payment for the invoice is due May 1, 2024."),
}


def test_rules_fire_on_no_other_paraphrase() -> None:
    """`guarded` stores again each paraphrase a rule fires on (its cost): a rule made broader fails here."""
    fired = {
        (p["existing"], p["incoming"])
        for p in PAIRS
        if p["kind"] == "paraphrase" and meaning_change(p["existing"], p["incoming"])
    }
    assert fired <= PARAPHRASES_A_RULE_FIRES_ON, fired - PARAPHRASES_A_RULE_FIRES_ON


def test_a_number_longer_than_int_takes_is_compared_not_a_failure() -> None:
    # int() refuses over 4,300 digits: one entry holding such a number failed every guarded decision against it
    # (its batch retried write by write, the write dead-lettered).
    digits = "1" * 4400
    assert meaning_change(f"Account id {digits}", f"Account id {digits[:-1]}2") == "value"
    assert meaning_change(f"Account id {digits}", f"Account id 0{digits}") is None  # a leading zero is the same number
    assert meaning_change(f"Budget {digits}k", f"Budget {digits}k") is None
