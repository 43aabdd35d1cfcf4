"""N-gram drafter (prompt lookup): match the sequence's last n tokens earlier in the sequence (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed the most
recent match."""

from __future__ import annotations

import torch

from specserve.spec_decode.proposer import Proposal, Proposer, ProposeInputs


def ngram_propose(ids: torch.Tensor, k: int, n_max: int, n_min: int) -> list[int]:
    """ids: 1-D long tensor of the whole sequence. Returns up to k continuation tokens."""
    L = ids.numel()
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n :]
        windows = ids[: L - 1].unfold(0, n, 1)  # every earlier n-gram (the suffix itself excluded)
        hits = (windows == suffix).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, num_speculative_tokens: int = 5, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1):
        if not (1 <= prompt_lookup_min <= prompt_lookup_max):
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, inputs: ProposeInputs) -> Proposal:
        chains = []
        for seq, k in zip(inputs.seqs, inputs.max_drafts):
            ids = torch.tensor(seq.all_ids, dtype=torch.long)
            chains.append(ngram_propose(ids, min(k, self.num_speculative_tokens), self.n_max, self.n_min))
        return Proposal(chains)


def add_branch(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int]]:
    """Insert the draft chain ``branch`` below the root of the tree (``tokens``, ``parents``: node 0 the
    root) as a trie does: follow the existing children that carry its tokens, then append the rest as
    new nodes (after every existing one, so ``parents[i] < i`` still holds). Returns new lists."""
    tokens, parents = list(tokens), list(parents)
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(parents)):
        children.setdefault((parents[i], tokens[i]), i)  # the first child with a token (verification's pick)
    node = 0
    for t in branch:
        nxt = children.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = children[(node, t)] = len(tokens) - 1
        node = nxt
    return tokens, parents
