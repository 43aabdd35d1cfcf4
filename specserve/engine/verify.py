"""One step's verification: the drafts of every running sequence (a chain or a tree each) become the
target forward's inputs (``forward_inputs``), and the target's logits become each sequence's emitted
tokens and the positions it keeps (``Verifier``): greedy argmax, coupled sampling
(``sample.coupled``), vLLM's rejection sampler for chains, recursive tree sampling, or a drafter's
opt-in lossy rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sample.coupled import coupled_tokens, verify_chain_coupled, verify_tree_coupled
from specserve.sample.rejection_sampler import PLACEHOLDER, rejection_sample
from specserve.sample.sampler import SamplingBatch, argmax, sample
from specserve.sample.tree import TreeBuffers, verify_tree_greedy, verify_tree_sample
from specserve.spec_decode.proposer import TreeDraft


def path_tree(k: int) -> TreeBuffers:
    """A chain of k drafts as a tree (root + a path of k nodes)."""
    return TreeBuffers.from_parents([-1] + list(range(k)))


@dataclass
class Drafts:
    """What one step verifies, one entry per running sequence: its chain of drafts, or its tree (the
    root is its last token); the draft distributions of sampled chains."""

    chains: list[list[int]]
    trees: list[TreeDraft | None]
    draft_probs: torch.Tensor | None = None

    @classmethod
    def none(cls, n: int) -> "Drafts":
        return cls([[] for _ in range(n)], [None] * n)

    @property
    def has_trees(self) -> bool:
        return any(t is not None for t in self.trees)

    def tokens_per_row(self) -> list[int]:
        """Tokens each row feeds the target (its last token included)."""
        return [len(t.tokens) if t is not None else 1 + len(c) for c, t in zip(self.chains, self.trees)]

    def depth(self, b: int) -> int:
        t = self.trees[b]
        return t.buffers.max_depth if t is not None else len(self.chains[b])


@dataclass
class ForwardInputs:
    tokens: list[list[int]]
    starts: list[int]
    tree_mask: list | None  # per row a bool [n, n] (None for a chain row); None without trees
    positions: list[list[int]] | None  # RoPE positions (trees: by depth); None without trees


def forward_inputs(seqs, drafts: Drafts) -> ForwardInputs:
    """Each row's last token + drafts (a chain), or its tree's nodes with their mask and depths."""
    starts = [s.num_computed for s in seqs]
    tokens, masks, positions = [], [], []
    for s, c, t, st in zip(seqs, drafts.chains, drafts.trees, starts):
        if t is not None:
            tokens.append(list(t.tokens))
            masks.append(t.buffers.attn_mask)
            positions.append((t.buffers.depth + st).tolist())
        else:
            tokens.append([s.output_ids[-1]] + c)
            masks.append(None)
            positions.append(list(range(st, st + 1 + len(c))))
    trees = drafts.has_trees
    return ForwardInputs(tokens, starts, masks if trees else None, positions if trees else None)


class Verifier:
    """Turns the target's logits into emitted tokens. ``sampling_mode`` "coupled": random rows by
    position-keyed draws (a seeded request's tokens are plain decoding's); "rejection": vLLM's rejection
    sampler and recursive tree sampling. ``lossy_verify``: a drafter's opt-in lossy tree rule for random
    rows (or None; a random row's chain is verified by it as a path tree). ``compact(row, src_positions,
    dst_start)``: moves a tree's accepted path's K/V to consecutive positions."""

    def __init__(self, sampling_mode: str, lossy_verify, compact):
        self.sampling_mode, self.lossy_verify, self.compact = sampling_mode, lossy_verify, compact

    def coupled(self, s) -> bool:
        return self.sampling_mode == "coupled" and not s.params.greedy and self.lossy_verify is None

    def next_tokens(self, seqs, logits: torch.Tensor) -> list[int]:
        """One token per sequence from ``logits`` [B, V] (its next position's, no drafts: the first
        token after a prefill): the position-keyed draw for coupled rows, plain sampling for the others."""
        sb = SamplingBatch.build([s.params for s in seqs], [s.generator for s in seqs], logits.device)
        tokens: list = [None] * len(seqs)
        rows = []
        for b, s in enumerate(seqs):
            if self.coupled(s):
                tokens[b] = coupled_tokens(logits[b : b + 1], sb.subset([b]), s.seed, [len(s.all_ids)])[0]
            else:
                rows.append(b)
        if rows:
            drawn = sample(logits[rows], sb.subset(rows) if len(rows) < len(seqs) else sb).tolist()
            for b, t in zip(rows, drawn):
                tokens[b] = t
        return tokens

    def verify(self, seqs, drafts: Drafts, starts: list[int],
               logits: torch.Tensor) -> list[tuple[list[int], list[int]]]:
        """Per sequence: (emitted tokens: accepted drafts + one target token, indices of the new
        positions now kept in the cache)."""
        def batch(rows: list[int]) -> SamplingBatch:  # sampling tensors, made only for rows that draw
            return SamplingBatch.build([seqs[b].params for b in rows], [seqs[b].generator for b in rows], logits.device)

        results: list = [None] * len(seqs)
        greedy_rows, chain_rows = [], []
        for b, s in enumerate(seqs):
            tree = drafts.trees[b]
            if tree is None and drafts.chains[b] and self.lossy_verify is not None and not s.params.greedy:
                tree = TreeDraft([s.output_ids[-1]] + drafts.chains[b], path_tree(len(drafts.chains[b])))
            if tree is not None:
                results[b] = self._tree(b, s, tree, logits, batch, starts[b])
            elif s.params.greedy:
                greedy_rows.append(b)
            elif self.coupled(s):
                emitted = verify_chain_coupled(drafts.chains[b], logits[b], batch([b]), s.seed,
                                               len(s.all_ids))
                results[b] = (emitted, list(range(len(emitted))))
            else:
                chain_rows.append(b)
        if greedy_rows:  # the target's argmax after each draft, drafts kept while they match it
            n = 1 + max(len(drafts.chains[b]) for b in greedy_rows)
            rows = logits[:, :n] if len(greedy_rows) == len(seqs) else logits[greedy_rows, :n]
            for b, am in zip(greedy_rows, argmax(rows).tolist()):
                chain, k = drafts.chains[b], 0
                while k < len(chain) and chain[k] == am[k]:
                    k += 1
                results[b] = (am[: k + 1], list(range(k + 1)))
        if chain_rows:  # rejection sampling (vLLM's semantics), the chain rows together
            maxk = max(len(drafts.chains[b]) for b in chain_rows)
            dp = drafts.draft_probs[chain_rows, :maxk] if drafts.draft_probs is not None else None
            res = rejection_sample([drafts.chains[b] for b in chain_rows], dp, logits[chain_rows, : maxk + 1],
                                   batch(chain_rows)).tolist()
            for b, row in zip(chain_rows, res):
                kept = [t for t in row if t != PLACEHOLDER]
                results[b] = (kept, list(range(len(kept))))
        return results

    def _tree(self, b, s, t: TreeDraft, logits, batch, start):
        """Row ``b``'s tree; ``batch(rows)``: the ``SamplingBatch`` of those rows (made when a row draws)."""
        n = len(t.tokens)
        tok = torch.tensor(t.tokens, dtype=torch.long)
        if s.params.greedy:
            nodes, extra = verify_tree_greedy(tok, logits[b, :n], t.buffers)
        elif self.coupled(s):
            nodes, extra = verify_tree_coupled(tok, logits[b, :n], t.buffers, batch([b]), s.seed, len(s.all_ids))
        elif self.lossy_verify is not None:
            nodes, extra = self.lossy_verify(t.tokens, logits[b, :n], t.buffers, s.params, s.generator)
        else:
            nodes, extra = verify_tree_sample(tok, logits[b, :n], t.buffers, batch([b]), s.generator)
        if nodes != list(range(len(nodes))):  # keep the accepted path's K/V, contiguous
            self.compact(b, [start + i for i in nodes], start)
        return [t.tokens[i] for i in nodes[1:]] + [int(extra)], nodes
