"""Instruction-style prompts for drafter training, made from templates and topics written here.

chitchat-dataset (the default training prompts) holds casual chat turns only; drafters trained on it
alone are poor on the requests people send an instruction-tuned model ("Explain ...", "Write ...",
"List ..."). No instruction dataset ships its data on PyPI, so these prompts are composed from
``TEMPLATES`` x ``TOPICS`` / ``ACTIVITIES``; the target writes the answers itself (self-distillation),
as for chitchat. ``load_instruction_prompts(split)`` splits them by a hash of the text (~10% held out,
the same rule as a prompts file) and orders each split by ``seed``.

The demo's question (``specserve demo``) is none of these prompts: no topic is about the sky.
"""

from __future__ import annotations

import random

from specserve.train.data import split_prompts

# noun phrases: "Explain {t}", "Write a short poem about {t}"
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "black holes", "the moon", "tides",
    "rainbows", "thunderstorms", "glaciers", "the human heart", "sleep", "vaccines", "antibiotics",
    "the immune system", "DNA", "evolution", "bees", "dolphins", "elephants", "octopuses", "coral reefs",
    "rain forests", "deserts", "recycling", "solar power", "wind turbines", "electric cars", "batteries",
    "the internet", "computer viruses", "passwords", "smartphones", "artificial intelligence",
    "video games", "social media", "email", "the printing press", "the steam engine", "the wheel",
    "ancient Rome", "ancient Egypt", "the pyramids", "the Olympic Games", "the Renaissance",
    "the French Revolution", "democracy", "taxes", "inflation", "money", "banks", "the stock market",
    "supply and demand", "coffee", "tea", "chocolate", "bread", "pizza", "cheese", "vegetables",
    "a healthy breakfast", "exercise", "running", "yoga", "swimming", "football", "basketball", "chess",
    "music", "jazz", "the piano", "the guitar", "painting", "poetry", "novels", "libraries", "museums",
    "friendship", "kindness", "honesty", "patience", "happiness", "stress", "time management",
    "public speaking", "job interviews", "teamwork", "leadership", "learning a language", "mathematics",
    "fractions", "prime numbers", "gravity", "magnets", "electricity", "light", "sound", "atoms",
    "the periodic table", "climate change", "air pollution", "plastic waste", "oceans", "mountains",
    "rivers", "islands", "cities", "trains", "airplanes", "bicycles", "rockets", "the International Space Station",
    "Mars", "Jupiter", "the sun", "stars", "dinosaurs", "fossils", "cats", "dogs", "horses", "birds",
    "butterflies", "trees", "flowers", "gardening", "camping", "holidays", "birthdays", "cooking",
    "baking", "soup", "salt", "sugar", "water", "milk", "the kitchen", "winter", "summer", "autumn",
    "spring", "weekends", "homework", "teachers", "school uniforms", "online classes", "board games",
    "movies", "photography", "robots", "bridges", "skyscrapers", "maps", "clocks", "calendars",
]

# verb phrases: "How do I {a}?", "Give me tips to {a}."
ACTIVITIES = [
    "learn a new language", "save money", "sleep better", "make new friends", "start running",
    "cook rice", "bake bread", "write a good essay", "prepare for an exam", "stay focused",
    "plant a garden", "care for a cat", "train a dog", "plan a trip", "pack for a holiday",
    "learn to code", "keep a journal", "read more books", "drink more water", "reduce stress",
    "give a good presentation", "write a cover letter", "negotiate a salary", "organize my desk",
    "wake up early", "eat healthier", "learn the guitar", "draw a portrait", "take better photos",
    "be a better listener", "apologize to a friend", "start a small business", "make a budget",
    "clean the kitchen", "fix a flat bicycle tire", "choose a laptop", "memorize vocabulary",
    "stay safe online", "make pancakes", "teach a child to read",
]

TEMPLATES_TOPIC = [
    "Explain {t} in simple terms.", "What is {t}?", "Tell me about {t}.", "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.", "Describe {t} to a ten-year-old.",
    "Write a short story that involves {t}.", "What are the advantages and disadvantages of {t}?",
    "Summarize what people should know about {t}.", "Why should people care about {t}?", "Explain the basics of {t}.",
    "Write a haiku about {t}.", "List five words related to {t}.", "What is a common misconception about {t}?",
    "Write one paragraph about the history of {t}.", "Give an example that explains {t}.",
    "Write a tweet about {t}.", "What questions would a student ask about {t}?",
    "Explain {t} in two sentences.", "Compare {t} and {u}.", "What do {t} and {u} have in common?",
    "Write a short dialogue between two friends about {t}.", "Write a product description for a book about {t}.",
]

TEMPLATES_ACTIVITY = [
    "How do I {a}?", "Give me tips to {a}.", "What are the steps to {a}?", "I want to {a}. Where do I start?",
    "What mistakes should I avoid when I try to {a}?", "Write a short plan to {a} in one week.",
    "Why is it hard to {a}?", "Explain to a beginner how to {a}.",
]


def all_instruction_prompts() -> list[str]:
    """Every prompt the templates make, in a fixed order (topic pairs: each topic with the next one)."""
    out = []
    n = len(TOPICS)
    for i, t in enumerate(TOPICS):
        u = TOPICS[(i + 7) % n]
        out += [tpl.format(t=t, u=u) for tpl in TEMPLATES_TOPIC]
    for a in ACTIVITIES:
        out += [tpl.format(a=a) for tpl in TEMPLATES_ACTIVITY]
    return list(dict.fromkeys(p[0].upper() + p[1:] for p in out))


def load_instruction_prompts(split: str = "train", n: int | None = None, seed: int = 0) -> list[str]:
    """The ``split`` ("train" or "heldout", by a hash of the text) of ``all_instruction_prompts``,
    shuffled by ``seed``, the first ``n`` (all if None)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    train, held = split_prompts(all_instruction_prompts())
    out = list(train if split == "train" else held)
    random.Random(seed).shuffle(out)
    return out if n is None else out[:n]
