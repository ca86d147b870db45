"""Cheap rules that stop the dedup step from swallowing contradictions.

Sentence embeddings score "prefers email over phone" vs "prefers phone over email",
"is allergic" vs "is not allergic" and "budget is 40,000" vs "budget is 65,000" at
0.97-0.99, above the duplicate threshold. Before a near-duplicate is skipped the writer
asks :func:`meaning_change`; a rule name means "store it, it says something else".
Pure and deterministic: no I/O, no model, tens of microseconds per call. The rules are
tuned to miss no contradiction; firing on a paraphrase only costs one extra stored fact.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from functools import cache

NEGATION_WORDS = frozenset({"not", "no", "never", "without", "none", "nobody", "nothing", "neither", "nor"})
NEGATING_PREFIXES = ("non", "dis", "un", "in", "im", "il", "ir")
# A shorter stem is too likely a coincidence ("unit" is not "un" + "it").
MIN_NEGATED_STEM = 3
# Words that carry no relation; dropped before the order and name checks.
STOPWORDS = frozenset(
    ["a", "an", "the", "is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did", "has", "have", "had", "will", "would", "shall", "should", "can", "could", "may", "might", "must", "i", "me", "my", "we", "our", "you", "your", "he", "him", "his", "she", "her", "it", "its", "they", "them", "their", "this", "that", "these", "those", "and", "or", "but", "so", "in", "on", "at", "of", "for", "with", "about", "as", "really", "very", "also", "just", "still", "actually", "quite", "definitely", "now", "currently", "always", "please"]
)
# Directional words stay in the token sequence: they are the pivot of "A over B".
RELATION_WORDS = frozenset(
    ["over", "than", "to", "from", "by", "before", "after", "instead", "rather", "versus", "vs", "above", "below", "under", "into", "against"]
)
_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
NUMBER_WORDS = dict(zip((_UNITS + " sixteen seventeen eighteen nineteen twenty").split(), range(21)))
NUMBER_WORDS |= {w: 10 * i for i, w in enumerate(["thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"], 3)}
ORDINAL_WORDS = {
    w: i for i, w in enumerate(["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"], 1)
}
MULTIPLIERS = {
    "k": 10**3, "hundred": 10**2, "thousand": 10**3, "m": 10**6, "million": 10**6, "bn": 10**9, "billion": 10**9
}
_MULTIPLIER_WORDS = frozenset({"hundred", "thousand", "million", "billion"})
# Units that are no ordinary word, each to the name it is compared by: written apart or not ("16 GB", "16GB"),
# a unit is part of its value.
_UNIT_NAMES = (
    "kb mb gb tb pb kib mib gib tib kbps mbps gbps mg kg lb oz km cm mm ft yd mph kph ml kw kwh mw gw hz khz mhz ghz ms"
)
UNITS = {unit: unit for unit in _UNIT_NAMES.split()} | {"lbs": "lb", "kmh": "kph"}
ORDINAL_SUFFIXES = frozenset({"st", "nd", "rd", "th"})
_MONTH_NAMES = "january february march april may june july august september october november december"
MONTHS = dict(zip(_MONTH_NAMES.split(), range(1, 13)))
MONTHS |= {m[:3]: i for m, i in list(MONTHS.items())} | {"sept": 9}
# Month names that are also ordinary words count only where some text writes them capitalised.
AMBIGUOUS_MONTHS = frozenset({"may", "march", "august", "mar", "aug"})
WEEKDAYS = {d: i for i, d in enumerate(["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"])}
TIME_WORDS = {"noon": "t12:00", "midday": "t12:00", "midnight": "t00:00"}
CONTRACTIONS = {"'re": "are", "'m": "am", "'ll": "will", "'ve": "have", "'d": "would"}
NT_BASES = {"won": "will", "can": "can", "shan": "shall", "ain": "is"}

_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
# Smart quotes are a keyboard setting, not a different fact.
_QUOTE_FOLD = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00ab": '"', "\u00bb": '"', "`": "'"}
)
_WS = re.compile(r"\s+")
# "London ." and "London." differ only in whitespace, so they must normalise alike.
_SPACE_AROUND_PUNCT = re.compile(r"\s+(?=[,.;:!?)\]}])|(?<=[(\[{])\s+")
_TOKEN = re.compile(
    r"(?P<date>\d{4}-\d{1,2}-\d{1,2}|\d{1,2}/\d{1,2}/\d{2,4})"
    r"|(?P<time>(?P<h>\d{1,2})(?::(?P<mi>\d{2}))?\s*(?P<ap>[ap])\.?m\b\.?|(?P<h24>\d{1,2}):(?P<m24>\d{2})\b)"
    r"|(?P<num>v?(?P<digits>\d+(?:[.,]\d+)*)(?P<suffix>[^\W\d_]*))"
    r"|(?P<word>[^\W\d_]+(?:['-][^\W\d_]+)*)",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.!?:;]")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"\d+(?:\.\d+)?")


def _fold(text: str) -> str:
    """NFKC (full-width letters, ligatures and the like are the same text), except for the compatibility forms
    that change what a number says: "10⁶" is not "106", "x₂" not "x2", "½" not "12"."""
    if (kept := _kept_forms()).search(text) is None:
        folded = unicodedata.normalize("NFKC", text)
    else:
        parts = kept.split(text)  # a kept character between every two others
        folded = "".join(_marked(part) if i % 2 else unicodedata.normalize("NFKC", part) for i, part in enumerate(parts))
    return folded.translate(_ZERO_WIDTH).translate(_QUOTE_FOLD)


def _marked(character: str) -> str:
    """A superscript, subscript or fraction as a form the value rules read and no plain text shares: "²" is "^2",
    "₂" is "_2", "½" is "1/2" (so "½ cup" and "¼ cup" differ in value, and "10⁶" is not "106")."""
    plain = unicodedata.normalize("NFKC", character).replace("\u2044", "/")
    kind = unicodedata.decomposition(character).split(" ", 1)[0]
    return {"<super>": "^", "<sub>": "_"}.get(kind, "") + plain


@cache
def _kept_forms() -> re.Pattern[str]:
    """Superscripts, subscripts and vulgar fractions, from the Unicode database (a scan of ~30 ms, once)."""
    kept = [
        chr(c) for c in range(0x30000)
        if unicodedata.decomposition(chr(c)).startswith(("<super>", "<sub>", "<fraction>"))
    ]
    return re.compile("([" + "".join(map(re.escape, kept)) + "])")


def normalize_content(text: str) -> str:
    """The form two texts share when they differ only in case, whitespace or trailing punctuation."""
    s = _SPACE_AROUND_PUNCT.sub("", _WS.sub(" ", _fold(text).casefold())).strip()
    while True:  # '"Tea."', 'Tea.' and 'tea' are one fact: peel until nothing changes
        before = s
        s = s.rstrip(".!?;:").strip()
        if len(s) >= 2 and s[0] in "\"'" and s[-1] == s[0]:
            s = s[1:-1].strip()
        if s == before:
            return s


def content_hash(text: str) -> str:
    """Hex sha256 of :func:`normalize_content`: the exact-copy key."""
    return hashlib.sha256(normalize_content(text).encode("utf-8")).hexdigest()


def _stem(word: str) -> str:
    # Only a final "s": enough for "likes"/"like" and "Mondays"/"Monday", and cannot over-merge.
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


_DIGITS_SCALED_MAX = 64
"""Longer amounts with a multiplier ("1234…k") compare as written: scaled, they would be numbers past int()'s limit."""


def _number(digits: str, suffix: str) -> str:
    if _THOUSANDS.fullmatch(digits):
        digits = digits.replace(",", "")  # "40,000" == "40000"
    suffix = "" if suffix.casefold() in ORDINAL_SUFFIXES else suffix.casefold()
    suffix = UNITS.get(suffix, suffix)
    if digits.isdigit() and not suffix:
        # Leading zeros dropped as text: int() refuses over 4,300 digits, and one such entry failed every
        # guarded decision against it.
        return digits.lstrip("0") or "0"
    if suffix in MULTIPLIERS and _DECIMAL.fullmatch(digits) and len(digits) <= _DIGITS_SCALED_MAX:
        whole, _, frac = digits.partition(".")
        return str(int(whole + frac) * MULTIPLIERS[suffix] // 10 ** len(frac))
    # "3.10" is not "3.1" when it is a version, so other values compare as written.
    return digits + suffix


class _Text:
    """One text split into the views the rules compare."""

    __slots__ = ("capitalised", "sequence", "values", "words")

    def __init__(self, text: str) -> None:
        self.words: list[str] = []  # casefolded, contractions expanded, in order
        self.capitalised: set[str] = set()  # written with a capital somewhere other than a sentence start
        self.values: list[str] = []  # canonical numbers, times, dates
        # Words and values ("#" + value) in text order: which value goes with which word.
        self.sequence: list[str] = []
        s, prev_end, start, last_num = _fold(text), 0, True, None
        for m in _TOKEN.finditer(s):
            start = start or bool(_SENTENCE_END.search(s, prev_end, m.start()))
            prev_end, word, num = m.end(), (m["word"] or "").casefold(), last_num
            last_num = None
            if num and word in MULTIPLIERS:  # "40 thousand", "5 hundred thousand"
                self.values[-1] = _number(num, word)
                self.sequence[-1] = "#" + self.values[-1]
                last_num = self.values[-1]  # a following multiplier multiplies again
            elif num and word in UNITS:  # "16 GB" is "16GB"
                self.values[-1] += UNITS[word]
                self.sequence[-1] = "#" + self.values[-1]
            elif m["date"]:
                self._add_value("d" + "-".join(p.zfill(2) for p in re.split(r"[-/]", m["date"])))
            elif m["time"]:
                h, mi = int(m["h"] or m["h24"]), int(m["mi"] or m["m24"] or 0)
                if m["ap"]:
                    h = h % 12 + (12 if m["ap"].casefold() == "p" else 0)
                self._add_value(f"t{h:02d}:{mi:02d}")
            elif m["num"]:
                self._add_value(_number(m["digits"], m["suffix"]))
                last_num = None if m["suffix"] else m["digits"]
            else:
                if not start and m["word"] != word:
                    self.capitalised.add(_stem(word))
                added = len(self.words)
                self._add_word(word)
                self.sequence += self.words[added:]
            start = False

    def _add_value(self, value: str) -> None:
        self.values.append(value)
        self.sequence.append("#" + value)

    def _add_word(self, w: str) -> None:
        if w.startswith("non-"):
            w = "non" + w[4:]  # "non-allergic" is "nonallergic"
        if w == "cannot":
            self.words += ["can", "not"]
        elif w.endswith("n't"):
            self.words += [NT_BASES.get(w[:-3], w[:-3]), "not"]
        elif w.endswith("'s"):
            self.words.append(w[:-2])  # "it's", "Alice's": the "is" or possessive carries no relation
        elif "'" in w and (tail := w[w.rfind("'") :]) in CONTRACTIONS:
            self.words += [w[: -len(tail)], CONTRACTIONS[tail]]
        else:
            self.words.append(w)


def _negations(words: list[str], other: set[str]) -> int:
    """Negation markers in words; a prefixed word counts only where other has it bare."""
    n = sum(w in NEGATION_WORDS for w in words)
    if "neither" in words:
        n -= words.count("nor")  # "neither A nor B" is one negation
    for w in words:
        if _stem(w) not in other:
            stem = next((w[len(p) :] for p in NEGATING_PREFIXES if w.startswith(p)), "")
            n += len(stem) >= MIN_NEGATED_STEM and _stem(stem) in other  # "unhappy" vs a bare "happy"
    return n


def _values(t: _Text, capitalised: set[str]) -> Counter[str]:
    out = Counter(t.values)
    words, counted_until = t.words, 0
    for i, w in enumerate(words):
        if i < counted_until:
            continue  # a multiplier counted with the number before it
        if w in NUMBER_WORDS and i + 1 < len(words) and words[i + 1] in _MULTIPLIER_WORDS:
            value, counted_until = NUMBER_WORDS[w], i + 1
            while counted_until < len(words) and words[counted_until] in _MULTIPLIER_WORDS:
                value *= MULTIPLIERS[words[counted_until]]  # "one hundred thousand" == "100000"
                counted_until += 1
            out[str(value)] += 1
        elif w in NUMBER_WORDS or w in ORDINAL_WORDS:
            out[str(NUMBER_WORDS[w] if w in NUMBER_WORDS else ORDINAL_WORDS[w])] += 1
        elif "-" in w and all(p in NUMBER_WORDS for p in w.split("-")):
            out[str(sum(NUMBER_WORDS[p] for p in w.split("-")))] += 1  # "twenty-five"
        elif w in TIME_WORDS:
            out[TIME_WORDS[w]] += 1
        elif _stem(w) in WEEKDAYS:
            out[f"w{WEEKDAYS[_stem(w)]}"] += 1
        elif w in MONTHS and (w not in AMBIGUOUS_MONTHS or w in capitalised):
            out[f"m{MONTHS[w]}"] += 1
    return out


def _occurrences(seq: list[str], keep: Counter[str]) -> list[tuple[str, int]]:
    """The tokens of seq that keep allows, repeats told apart as (word, nth)."""
    seen: Counter[str] = Counter()
    out = []
    for w in seq:
        seen[w] += 1
        if seen[w] <= keep[w]:
            out.append((w, seen[w]))
    return out


def _order_flipped(a: list[str], b: list[str]) -> bool:
    """True when two shared tokens sit on opposite sides of a shared pivot in a and in b.

    A fronted phrase ("In March, X" vs "X in March") moves one token across the others and
    does not fire; "A over B" vs "B over A" moves A and B across "over" in opposite directions.
    """
    shared = Counter(a) & Counter(b)
    la, lb = _occurrences(a, shared), _occurrences(b, shared)
    if la == lb:
        return False
    pos_b = {tok: i for i, tok in enumerate(lb)}
    order = [pos_b[tok] for tok in la]  # a's shared tokens as positions in b
    return any(
        any(q > p for q in order[:i]) and any(q < p for q in order[i + 1 :]) for i, p in enumerate(order)
    )


def meaning_change(existing: str, incoming: str) -> str | None:
    """None if cheap rules see the same fact; else the rule that fired: "negation", "value", "order"."""
    if normalize_content(existing) == normalize_content(incoming):
        return None
    a, b = _Text(existing), _Text(incoming)
    if _negations(a.words, {_stem(w) for w in b.words}) != _negations(b.words, {_stem(w) for w in a.words}):
        return "negation"
    capitalised = a.capitalised | b.capitalised  # a name stays a name when the other text lowercases it
    if _values(a, capitalised) != _values(b, capitalised):
        return "value"
    ca, cb = _content(a), _content(b)
    wa, wb = [w for w in ca if not w.startswith("#")], [w for w in cb if not w.startswith("#")]
    only_a, only_b = Counter(wa) - Counter(wb), Counter(wb) - Counter(wa)
    # A name swapped for another ("Berlin" -> "Munich"), not merely added or dropped.
    if only_a and only_b and any(w in capitalised for w in only_a | only_b):
        return "value"
    if _order_flipped(wa, wb):
        return "order"
    # Only when the shared values themselves trade places ("16 GB and 4 CPUs" / "4 GB and 16 CPUs") do they
    # join the comparison: a phrase with one value moved elsewhere ("at 9am every Monday") is a paraphrase.
    va, vb = [w for w in ca if w.startswith("#")], [w for w in cb if w.startswith("#")]
    shared = Counter(va) & Counter(vb)
    if _occurrences(va, shared) != _occurrences(vb, shared) and _order_flipped(ca, cb):
        return "order"
    return None


def _content(t: _Text) -> list[str]:
    """The tokens the order rule compares: values ("#…"), and stemmed words other than stopwords (the
    directional ones stay, as pivots)."""
    return [w if w.startswith("#") else _stem(w) for w in t.sequence if w not in STOPWORDS or w in RELATION_WORDS]
