"""Each method's default configuration: what ``{"method": X}`` (and ``--speculative-method X``) runs.

A plain method name runs the configuration the bench finds fastest on broad prompts
(docs/benchmarks.md): for the model drafters a draft tree sized every step by the cost model, with
the pooled n-gram branches beside the drafter's own nodes (``TREES``, ``OWN``). The simpler variants stay
one key away, and a key the user gives always wins:

* ``{"method": "medusa", "medusa_tree": None}``: a chain (each head's top token), still cut per step
  by the cost model (``medusa_verify: "auto"``); add ``"medusa_verify": "full"`` to verify the whole
  chain every step (the original Medusa-1 decoding);
* ``{"method": "dspark", "dspark_tree": None}`` (the same for ``dflash``): a chain of the block's
  drafts, every one verified; ``"dspark_verify": "auto"`` / ``"threshold"`` or
  ``"draft_sample_method": "probabilistic"`` ask for chain modes too, so the tree default steps aside
  for them;
* ``"ngram_branch": 0``: no n-gram branches (``ngram_branch``, ``ngram_candidates`` or ``ngram_pool``
  replaces the default branches; ``ngram_datastore`` alone adds a datastore to them).

N-gram branches ride on the drafter's tree: with a chain they would be verified whole every step,
so they are a default only where the tree is.

``{"method": "ngram"}`` drafts up to three continuations, from the sequence and from earlier requests,
and verifies what the cost model finds worth it (``NGRAM``); ``"ngram_verify": "full"`` is vLLM's
n-gram drafting (the most recent match's continuation, every token verified) and takes none of these
defaults. ``target`` has no defaults beyond its options' own.
"""

from __future__ import annotations

from specserve.spec_decode.ngram.branches import POOLED_BRANCHES

# method -> (the tree key, its default value, keys whose non-default values ask for a chain)
TREES: dict[str, tuple[str, object, dict]] = {
    "medusa": ("medusa_tree", "auto", {}),
    "dspark": ("dspark_tree", "auto", {"dspark_verify": "full", "draft_sample_method": "greedy"}),
    "dflash": ("dspark_tree", "auto", {"dspark_verify": "full", "draft_sample_method": "greedy"}),
}
# method -> defaults of its own that apply whatever the tree
OWN: dict[str, dict] = {"medusa": {"medusa_verify": "auto"}}
# the n-gram drafter's defaults, unless "ngram_verify" asks for "full"
NGRAM = {"ngram_verify": "auto", "ngram_candidates": 3, "ngram_pool": True}


def with_defaults(method: str, options: dict) -> dict:
    """``options`` (a ``speculative_config``'s keys other than ``method``) with ``method``'s defaults
    filled in where the user gave none (the rules in this module's docstring)."""
    if method == "ngram" and options.get("ngram_verify", "auto") == "auto":
        return {**NGRAM, **options}
    if method not in TREES:
        return dict(options)
    tree_key, tree_default, chain_keys = TREES[method]
    out = {**OWN.get(method, {}), **options}
    wants_chain = any(k in options and options[k] != v for k, v in chain_keys.items())
    if tree_key not in options and not wants_chain:
        out[tree_key] = tree_default
    if out.get(tree_key) is not None and not any(k in options for k in POOLED_BRANCHES):
        out.update(POOLED_BRANCHES)
    return out


def resolve(config: dict) -> dict:
    """A ``speculative_config`` dict with its method's defaults filled in: the configuration that runs
    (for docs, tests and ``--speculative-config`` users who want to see it)."""
    config = dict(config)
    method = config.pop("method")
    return {"method": method, **with_defaults(method, config)}
