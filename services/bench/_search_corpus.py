"""The search benchmark's corpus: facts about people and teams, each written in several paraphrases, and
queries asked in other words; plus a deterministic stand-in embedder for quick runs.

A fact is a kind (a set of paraphrase templates) with its slots filled; its paraphrases form a tight
cluster in embedding space, as restatements of one fact do in a real memory. Queries are questions about
a stored fact, phrased like none of its entries.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

import numpy as np

# Words that fill the slots of the templates, one slot kind a line ("|" separates multi-word values).
_WORDS = """
first: Alice Bruno Chen Dana Emeka Farah Goran Hana Ivan Julia Kenji Lena Marco Nadia Omar Priya Quinn Rosa Sven
    Tara Umar Vera Wei Ximena Yusuf Zoe Aaron Beatriz Carlos Dmitri Elif Fatima Gustav Hiro Ines Jonas Kamala Luca
    Mei Nikolai Olga Pablo Rania Sami Tomas Ulla Viktor Wanda Yara Zaid Amara Bilal Clara Diego Esther Felix Greta
    Hugo Ingrid Jamal Keiko Lars Maya Nils Oscar Paula Rafael Sofia Theo Valentina
last: Smith Garcia Müller Rossi Novak Kowalski Tanaka Okafor Haddad Silva Jensen Dubois Ivanova Kim Patel Nguyen
    Cohen Schmidt Moreau Larsen Costa Yilmaz Andersson Fischer Romano Lopez Mendes Weber Petrov Hansen Berg Ali Sato
    Kaur Bianchi Varga Horvat Popescu Lindqvist Murphy
city: Lisbon Berlin Osaka Lagos Toronto Austin Lyon Krakow Nairobi Seoul Porto Denver Oslo Madrid Chennai Melbourne
    Dublin Prague Bogota Hamburg Milan Boston Helsinki Accra Quito Vienna Utrecht Ghent Bergen Tartu
street: Oak Maple Harbor Mill Station Church Garden Bridge River Market Park Hill Cedar Elm Lake
channel: email phone text|message video|call post chat
team: billing platform mobile data security support growth design finance logistics legal research
tool: Jira Linear Trello Asana Slack Teams Jenkins GitHub GitLab Confluence Notion Airflow Datadog Sentry
food: peanuts shellfish gluten lactose soy eggs sesame walnuts strawberries mustard celery kiwi
product: Atlas Beacon Cobalt Drift Ember Fjord Granite Harbor Iris Juniper
plan: free starter team business enterprise
day: Monday Tuesday Wednesday Thursday Friday
lang: Portuguese German Japanese French Spanish Polish Korean Italian Dutch Finnish Turkish Swedish
month: January February March April May June July August September October November December
role: team|lead product|owner on-call|engineer release|manager account|manager tech|lead
device: ThinkPad MacBook|Pro Dell|XPS Surface|Laptop Framework|laptop
os: Linux macOS Windows|11 ChromeOS
tz: CET EST PST JST IST GMT AEST
"""


def _parse_words(block: str) -> dict[str, list[str]]:
    words: dict[str, list[str]] = {}
    for line in block.replace("\n    ", " ").strip().splitlines():
        kind, _, values = line.partition(": ")
        words[kind] = [value.replace("|", " ") for value in values.split()]
    return words


WORDS = _parse_words(_WORDS)

# kind -> (statement paraphrases, question forms)
# fmt: off
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "contact": (
        ("{person} prefers {channel} over {channel2}",
         "{person} would rather be reached by {channel} than by {channel2}",
         "When contacting {person}, use {channel}, not {channel2}",
         "{person}'s preferred contact channel is {channel}; avoid {channel2}",
         "Reach out to {person} through {channel} instead of {channel2}"),
        ("How should we contact {person}?", "What is the best way to reach {person}?"),
    ),
    "address": (
        ("{person} lives at {num} {street} Street in {city}",
         "{person}'s home address is {num} {street} Street, {city}",
         "Ship orders for {person} to {num} {street} St, {city}",
         "{person} moved to {num} {street} Street in {city}"),
        ("Where does {person} live?", "What is {person}'s shipping address?"),
    ),
    "migration": (
        ("The {team} team decided to migrate from {tool} to {tool2}",
         "{team} is moving off {tool} and onto {tool2}",
         "Decision: the {team} group replaces {tool} with {tool2}",
         "The {team} team agreed to switch from {tool} to {tool2} next quarter"),
        ("Which tool is the {team} team switching to?", "What is {team} replacing {tool} with?"),
    ),
    "allergy": (
        ("{person} is allergic to {food}", "{person} cannot eat {food} because of an allergy",
         "Never serve {food} to {person}: allergy", "{person} has a severe {food} allergy"),
        ("What is {person} allergic to?", "Which foods must {person} avoid?"),
    ),
    "plan": (
        ("{person} has the {product} subscription on the {plan} plan",
         "{person} pays for {product} on the {plan} tier",
         "{person}'s account runs {product} with the {plan} plan",
         "The {product} plan for {person} is {plan}"),
        ("Which {product} plan is {person} on?", "What does {person} pay for {product}?"),
    ),
    "meeting": (
        ("{person} meets the {team} team every {day} at {hour}",
         "The weekly {team} sync with {person} is on {day}s at {hour}",
         "{person} joins {team} each {day} at {hour}"),
        ("When does {person} meet the {team} team?", "What day is the {team} sync with {person}?"),
    ),
    "language": (
        ("{person} speaks {lang} and wants documents in {lang}", "Send {person} material written in {lang}",
         "{person}'s working language is {lang}"),
        ("Which language does {person} prefer?", "In what language should we write to {person}?"),
    ),
    "birthday": (
        ("{person}'s birthday is on {month} {dom}", "{person} was born on {dom} {month}",
         "Remember {person}'s birthday: {month} {dom}"),
        ("When is {person}'s birthday?", "What is {person}'s date of birth?"),
    ),
    "refunds": (
        ("Refunds above ${amount} for {product} need approval from {person}",
         "{person} must approve any {product} refund over ${amount}",
         "Any {product} refund larger than ${amount} goes to {person} for sign-off"),
        ("Who approves large {product} refunds?", "Which refunds need {person}'s approval?"),
    ),
    "role": (
        ("{person} is the {role} of the {team} team", "The {team} team's {role} is {person}",
         "{person} works as {role} in {team}"),
        ("Who is the {role} of {team}?", "What is {person}'s role on the {team} team?"),
    ),
    "device": (
        ("{person} uses a {device} running {os}", "{person}'s work laptop is a {device} with {os}",
         "{person} works on {os} on a {device}"),
        ("What computer does {person} use?", "Which operating system does {person} work on?"),
    ),
    "timezone": (
        ("{person} works from {city} in the {tz} time zone", "{person} is based in {city} ({tz})",
         "Schedule calls with {person} in {tz}; they live in {city}"),
        ("What time zone is {person} in?", "Where is {person} based?"),
    ),
}
# fmt: on


@dataclass(frozen=True)
class Fact:
    kind: str
    slots: dict[str, str]

    def statement(self, variant: int) -> str:
        templates = KINDS[self.kind][0]
        return templates[variant % len(templates)].format(**self.slots)

    def question(self, variant: int) -> str:
        questions = KINDS[self.kind][1]
        return questions[variant % len(questions)].format(**self.slots)


def _slots(rng: random.Random) -> dict[str, str]:
    def pick(kind: str) -> str:
        return rng.choice(WORDS[kind])

    channel, channel2 = rng.sample(WORDS["channel"], 2)
    tool, tool2 = rng.sample(WORDS["tool"], 2)
    # fmt: off
    return {  # drawn in this order, so that a seed always makes the same corpus
        "person": f"{pick('first')} {pick('last')}", "channel": channel, "channel2": channel2,
        "num": str(rng.randint(1, 299)), "street": pick("street"), "city": pick("city"), "team": pick("team"),
        "tool": tool, "tool2": tool2, "food": pick("food"), "product": pick("product"), "plan": pick("plan"),
        "day": pick("day"), "hour": f"{rng.randint(8, 17)}:{rng.choice(['00', '30'])}", "lang": pick("lang"),
        "month": pick("month"), "dom": str(rng.randint(1, 28)),
        "amount": str(rng.choice([50, 100, 250, 500])), "role": pick("role"), "device": pick("device"), "os": pick("os"), "tz": pick("tz"),
    }
    # fmt: on


@dataclass(frozen=True)
class Entry:
    fact: int  # index of the fact it states
    content: str
    memory: int  # index of the memory it is written to
    tags: list[str]


def corpus(entries: int, memories: int, seed: int) -> tuple[list[Fact], list[Entry]]:
    """`entries` paraphrases of about entries/3 facts; a fact's paraphrases live in one memory, as
    restatements of one fact do. No text appears twice (the writer would skip an exact copy, and copies
    are what a vector index handles worst). Every entry has a `source:` tag; one in fifty is also
    `flag:escalated`."""
    rng = random.Random(seed)
    kinds = sorted(KINDS)
    facts: list[Fact] = []
    rows: list[Entry] = []
    seen: set[str] = set()
    while len(rows) < entries:
        fact = Fact(rng.choice(kinds), _slots(rng))
        facts.append(fact)
        memory = rng.randrange(memories)
        for variant in rng.sample(
            range(len(KINDS[fact.kind][0])), k=rng.randint(1, len(KINDS[fact.kind][0]))
        ):
            tags = [f"source:{rng.choice(['chat', 'email', 'ticket', 'crm'])}"]
            if rng.random() < 0.02:
                tags.append("flag:escalated")
            content = fact.statement(variant)
            if content in seen:
                continue
            seen.add(content)
            rows.append(Entry(len(facts) - 1, content, memory, tags))
            if len(rows) == entries:
                break
    return facts, rows


def memory_tags(index: int) -> list[str]:
    regions = ["emea", "apac", "amer", "latam", "nordics", "dach", "benelux", "iberia"]
    return [f"region:{regions[index % len(regions)]}", f"tier:{['gold', 'silver', 'bronze'][index % 3]}"]


class HashedEmbedder:
    """Deterministic stand-in for a sentence model: each word gets a fixed pseudo-random direction (seeded
    by its hash) and a text is the normalised sum of its words'. Paraphrases share their content words, so
    they land close together; it is thousands of times faster than MiniLM, and not a language model."""

    name = "hashed-bag-of-words-384"
    # fmt: off
    _STOP = frozenset(("a", "an", "the", "is", "of", "on", "in", "at", "to", "for", "and", "or", "by", "with",
                       "be", "was", "are", "has", "its", "their", "they"))
    # fmt: on

    def __init__(self, dimensions: int = 384) -> None:
        self.dimensions = dimensions
        self._words: dict[str, np.ndarray] = {}

    def _word(self, word: str) -> np.ndarray:
        vector = self._words.get(word)
        if vector is None:
            seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
            vector = np.random.default_rng(seed).standard_normal(self.dimensions).astype(np.float32)
            self._words[word] = vector
        return vector

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"[\w$']+", text.lower()):
                out[row] += self._word(word) * (0.2 if word in self._STOP else 1.0)
            norm = float(np.linalg.norm(out[row]))
            out[row] = out[row] / norm if norm else self._word("")
        return out
