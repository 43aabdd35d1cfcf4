"""The n-gram drafter's ``speculative_config`` keys, and those of n-gram branches beside another drafter."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.options import option

PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN = 4, 1  # the n-gram lengths matched by default (longest first)
VERIFY_MODES = ("full", "auto")
DATASTORE_HELP = ("also continue phrases of a datastore of answers (ngram.datastore): 'auto' (the one shipped for the "
                  "target, if any), a distillation store directory, or None")


@dataclass(frozen=True)
class NgramOptions:
    num_speculative_tokens: int = option(5, "draft tokens per step", lo=1, hi=32)
    prompt_lookup_max: int = option(PROMPT_LOOKUP_MAX, "the longest n-gram matched", lo=1)
    prompt_lookup_min: int = option(PROMPT_LOOKUP_MIN, "the shortest n-gram matched", lo=1)
    ngram_verify: str = option("full", "'full': every drafted token verified (vLLM's n-gram drafting); 'auto': "
                               "as many as the cost model finds worth", choices=VERIFY_MODES)
    ngram_candidates: int = option(1, "continuations drafted per step (more than 1: a tree)", lo=1, hi=8)
    ngram_pool: bool = option(False, "also continue phrases of earlier requests, not only the sequence's own")
    ngram_datastore: str | None = option(None, DATASTORE_HELP, expect="'auto', a path or None")

    def __post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")


@dataclass(frozen=True)
class NgramBranchOptions:
    """N-gram branches added to another drafter's drafts (``ngram.branches``)."""

    ngram_branch: int = option(0, "tokens per n-gram branch (0: no branches)", lo=0, hi=32)
    ngram_candidates: int = option(1, "n-gram branches per step (distinct continuations)", lo=1, hi=8)
    ngram_pool: bool = option(False, "also continue phrases of earlier requests, not only the sequence's own")
    ngram_datastore: str | None = option(None, DATASTORE_HELP, expect="'auto', a path or None")

    def __post_init__(self) -> None:
        if not self.ngram_branch and (self.ngram_candidates != 1 or self.ngram_pool or self.ngram_datastore):
            raise ValueError("ngram_candidates, ngram_pool and ngram_datastore need ngram_branch (tokens per "
                             "branch) > 0")
