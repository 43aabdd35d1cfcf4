"""The oracle n-gram row (``ngram-oracle``): the most an n-gram drafter (prompt lookup over the
sequence's own tokens) can be accepted, on the bench's prompts.

It is computed, not run: it is fed plain decoding's output of each prompt (the ``none`` row's, the
target's own answer) and replays decoding it step by step, as the engine would with a drafter: at
each step the context is the prompt plus the answer so far; every earlier occurrence of the context's
last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) offers the tokens that
followed it (``ngram.index.NgramIndex``), at most ``num_speculative_tokens`` and no more than
the request has room for; the oracle keeps the offer that the answer accepts longest, so the step
emits its accepted tokens plus one. With ``choose="recent"`` the replay keeps the most recent longest
match instead, which is what vLLM's n-gram drafting proposes (``"ngram_verify": "full"``, the
``ngram-chain`` row): the replay of that rule gives the engine's own figures for it (a test checks
it), so the oracle's are read on the same scale. (The ``ngram`` default also continues phrases of
earlier requests, which the oracle does not see.)

The row has no speed (``tokens_per_s`` is null): only its acceptance figures mean something. Its
keys are the n-gram drafter's (``--speculative-config 'NAME={"method": "ngram-oracle", ...}'``).
"""

from __future__ import annotations

from specserve.spec_decode.metrics import SpecMetrics
from specserve.spec_decode.ngram.config import NgramOptions
from specserve.spec_decode.ngram.index import NgramIndex
from specserve.spec_decode.options import parse_options

METHOD = "ngram-oracle"
ORACLE_DRAFTS = 7  # the preset's drafts per step: as many as the shipped block drafters propose


def accepted_prefix(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def replay_ngram(prompt: list[int], output: list[int], max_tokens: int, opts: NgramOptions,
                 choose: str = "oracle") -> SpecMetrics:
    """The metrics of decoding ``output`` after ``prompt`` with n-gram drafts chosen by ``choose``
    ("oracle": the offer accepted longest; "recent": the ``ngram`` drafter's own choice)."""
    if choose not in ("oracle", "recent"):
        raise ValueError(f"choose must be 'oracle' or 'recent', got {choose!r}")
    m = SpecMetrics()
    index = NgramIndex(opts.prompt_lookup_max, opts.prompt_lookup_min)
    t = 1  # the first token comes from the prefill
    while t < len(output):
        k = min(opts.num_speculative_tokens, max(0, max_tokens - t - 1))  # the engine's room
        truth = output[t:]
        offers = []
        if k:
            limit = 1 if choose == "recent" else 1 << 30
            offers = [c for c, _ in index.update(prompt + output[:t]).candidates(k, limit)]
        best = max(offers, key=lambda c: accepted_prefix(c, truth), default=[])
        accepted = accepted_prefix(best, truth)
        m.record(len(best), accepted)
        t += accepted + 1
    return m


class NgramOracleMethod:
    """A bench row computed from the ``none`` row's outputs (``derived``)."""

    derived = True

    def __init__(self, name: str = METHOD, config: dict | None = None):
        self.name = name
        keys = {k: v for k, v in (config or {"num_speculative_tokens": ORACLE_DRAFTS}).items() if k != "method"}
        self.opts = parse_options(NgramOptions, keys, METHOD)

    def derive(self, ctx, base) -> list[SpecMetrics]:
        """Per prompt, the replay's metrics over plain decoding's output (``base``, a ``MethodResult``)."""
        return [replay_ngram(list(p), list(o), ctx.max_tokens, self.opts) for p, o in zip(ctx.prompt_ids, base.outputs)]
