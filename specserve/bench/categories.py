"""The bench's prompts by category, and its figures per category.

``--prompts categories`` runs the stored held-out prompts of every category (``STORED_FILE``, written
by ``scripts/make_category_prompts.py`` from ``train/categories.py``: the same prompts on every machine,
ShareGPT package or not), ``--prompts category:NAME`` (or ``category:A,B``) those of some; with
``--num-prompts N`` the first N of each category. Every row then gets ``categories``: per category its
generated tokens, tau, acceptance rate per position, where drafts fail first (``first_rejected``: the
share of drafting steps whose first rejected draft was at position 1, 2, ...; ``all_accepted``: the
share that accepted every draft), tokens/s over plain decoding on the same prompts and, for a drafter
with a draft vocabulary of its own (DSpark/DFlash with a pruned head), the share of plain decoding's
tokens that vocabulary holds (``coverage``). ``format_category_table`` prints them after the main table.
"""

from __future__ import annotations

from pathlib import Path

from specserve.spec_decode.metrics import SpecMetrics
from specserve.train.categories import CATEGORIES, read_heldout_file
from specserve.train.data import DataError

STORED_FILE = Path(__file__).with_name("categories-heldout.jsonl.gz")
ALL = "categories"
ONE = "category:"


def is_category_spec(spec) -> bool:
    return spec is not None and (str(spec) == ALL or str(spec).startswith(ONE))


def category_prompts(spec: str, per_category: int | None = None,
                     path: str | Path | None = None) -> list[tuple[str, str]]:
    """``[(category, prompt)]`` of a ``--prompts`` value ``categories`` or ``category:A[,B]``: the
    stored held-out prompts of those categories, category by category, the first ``per_category`` of
    each (all if None)."""
    spec = str(spec)
    wanted = list(CATEGORIES) if spec == ALL else [c.strip() for c in spec[len(ONE):].split(",") if c.strip()]
    bad = [c for c in wanted if c not in CATEGORIES]
    if bad or not wanted:
        raise DataError(f"--prompts {spec}: categories are {', '.join(CATEGORIES)}")
    recs = read_heldout_file(path or STORED_FILE)
    out = []
    for c in wanted:
        mine = [r["prompt"] for r in recs if r["category"] == c]
        out += [(c, p) for p in mine[:per_category]]
    return out


def draft_vocabulary(llm) -> set[int] | None:
    """The target ids a drafter can propose when it has a draft vocabulary of its own, else None."""
    proposer = llm.engine.proposer
    vocab = getattr(getattr(proposer, "inner", proposer), "draft_vocabulary", None)
    ids = vocab() if callable(vocab) else None
    return None if ids is None else {int(t) for t in ids}


def prompt_metrics(result) -> list[SpecMetrics] | None:
    return result.details.get("metrics")


def category_figures(labels: list[str], result, base) -> dict[str, dict]:
    """Per category (in ``labels``' order): the row's figures over that category's prompts (module
    docstring). ``result``/``base``: the row's and plain decoding's ``MethodResult``."""
    metrics, walls = prompt_metrics(result), result.details.get("walls")
    base_walls = base.details.get("walls")
    vocab = result.details.get("draft_vocabulary")
    out: dict[str, dict] = {}
    for cat in dict.fromkeys(labels):
        idx = [i for i, c in enumerate(labels) if c == cat]
        tokens = sum(len(result.outputs[i]) for i in idx)
        fig: dict = {"prompts": len(idx), "tokens": tokens}
        if walls and base_walls:
            tps = tokens / max(1e-9, sum(walls[i] for i in idx))
            base_tps = sum(len(base.outputs[i]) for i in idx) / max(1e-9, sum(base_walls[i] for i in idx))
            fig["speedup_vs_none"] = round(tps / base_tps, 4) if base_tps and sum(walls[i] for i in idx) else None
        if metrics:
            m = SpecMetrics()
            for i in idx:
                m.merge(metrics[i])
            d = m.as_dict()
            fig["mean_acceptance_length"] = round(d["mean_acceptance_length"], 4)
            fig["acceptance_rate_per_position"] = [round(r, 4) for r in d["acceptance_rate_per_position"]]
            fig.update(first_failure(m))
        if vocab is not None:
            plain = [t for i in idx for t in base.outputs[i]]
            fig["coverage"] = round(sum(t in vocab for t in plain) / len(plain), 4) if plain else None
        out[cat] = fig
    return out


def first_failure(m: SpecMetrics) -> dict:
    """Where drafts fail first: the share of drafting steps whose first rejected draft was at position
    1, 2, ... (``first_rejected``) and the share that accepted all their drafts (``all_accepted``)."""
    n = m.num_drafts
    if not n:
        return {"first_rejected": [], "all_accepted": None}
    shares = [round(c / n, 4) for c in m.first_rejected_per_position]
    return {"first_rejected": shares, "all_accepted": round(1 - sum(m.first_rejected_per_position) / n, 4)}


def format_category_table(rows: list[dict]) -> str:
    """One line per (category, method) of the rows that carry ``categories``: tokens, tau, tok/s over
    plain decoding, coverage, acceptance rate per position and where drafts fail first."""
    head = ["category", "method", "tokens", "acc.len", "vs none", "coverage", "acc. rate by position",
            "first rejection at 1/2/3/... (all accepted)"]
    body = []
    cats = list(dict.fromkeys(c for r in rows for c in r.get("categories", {})))
    for cat in cats:
        for r in rows:
            f = r.get("categories", {}).get(cat)
            if f is None or r["method"] == "none":
                continue
            rates = " ".join(f"{x:.2f}" for x in f.get("acceptance_rate_per_position", []))
            first = " ".join(f"{x:.2f}" for x in f.get("first_rejected", []))
            if f.get("all_accepted") is not None:
                first += f" ({f['all_accepted']:.2f})"
            ratio = f.get("speedup_vs_none")
            cov = f.get("coverage")
            body.append([cat, r["method"], str(f["tokens"]), f"{f.get('mean_acceptance_length', 1.0):.2f}",
                         "-" if ratio is None else f"{ratio:.2f}x", "-" if cov is None else f"{cov:.3f}",
                         rates or "-", first or "-"])
    if not body:
        return ""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def parse_ab_arguments(ap):
    """The A/B scripts' common options added to an ``argparse`` parser (``--num-prompts``: held-out prompts
    per category, ``--max-tokens``, ``--threads``), the command line parsed, torch's threads set (before
    any engine is built): returns the parsed arguments."""
    import torch

    ap.add_argument("--num-prompts", type=int, default=6, help="held-out prompts per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def interleaved_chats(engines: dict, args, prompts: list[tuple[str, str]] | None = None, size: int = 1,
                      temperature: float = 0.0, references: dict | None = None) -> tuple:
    """``prompts`` ((category, prompt) pairs; default: ``args.num_prompts`` held-out prompts of every
    category), ``size`` at a time as one call of one-turn chats of up to ``args.max_tokens`` tokens (a call's
    category: its first prompt's), through every ``LLM`` of ``engines`` ({name: LLM}) in turn, the order
    reversed every other call, so that a machine whose speed drifts weighs on every engine alike (the A/B
    scripts under ``scripts/``). Greedy, or sampled at ``temperature`` with the call's index as seed. Returns
    the (category, prompt) pairs, then (wall seconds, generated tokens), Counters keyed by name and by
    (category, name), and per name how many calls' answers equal its reference's token for token
    (``references[name]``, another engine's name; default the first engine)."""
    import collections
    import time

    from specserve import SamplingParams

    if prompts is None:
        prompts = category_prompts("categories", args.num_prompts)
    wall, tokens, same = collections.Counter(), collections.Counter(), collections.Counter()
    first = next(iter(engines))
    for i in range(0, len(prompts), size):
        group = prompts[i : i + size]
        cat = group[0][0]
        params = SamplingParams(temperature=temperature, seed=i // size if temperature > 0 else None,
                                max_tokens=args.max_tokens)
        names = list(engines) if (i // size) % 2 == 0 else list(engines)[::-1]
        out = {}
        for name in names:
            t0 = time.perf_counter()
            res = engines[name].chat([[{"role": "user", "content": p}] for _, p in group], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            out[name] = [list(r.outputs[0].token_ids) for r in res]
            for key in (name, (cat, name)):
                wall[key] += dt
                tokens[key] += sum(map(len, out[name]))
        for name in engines:
            same[name] += out[name] == out[(references or {}).get(name, first)]
    return prompts, wall, tokens, same


def print_ab_table(label: str, args, names, prompts, wall, tokens, same) -> None:
    """The A/B scripts' table of ``interleaved_chats``' figures: each engine's tok/s, speed over the first
    one (plain decoding) and how many answers equal its own, under a line saying what ran."""
    first = next(iter(names))
    t = getattr(args, "temperature", 0.0)
    kind = f"temperature {t:g} (seeded)" if t else "greedy"
    print(f"{label}{len(prompts)} prompts, {args.max_tokens} tokens, {kind}, {args.threads} threads")
    print("| row | tok/s | x plain | identical to plain |\n|---|---|---|---|")
    for name in names:
        print(f"| {name} | {tokens[name] / wall[name]:.1f} | {wall[first] / wall[name]:.3f}x | "
              f"{same[name]}/{len(prompts)} |")
