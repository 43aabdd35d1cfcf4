"""DSpark's heads on the draft slots: the Markov head (a bias on each draft position's logits from
the previous draft token) and the confidence head (the probability that a draft is accepted)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import default_weight_loader
from specserve.spec_decode.dspark.config import MARKOV_HEAD_TYPES


class MarkovHead(nn.Module):
    """Low-rank transition bias over the draft vocabulary, conditioned on the previous token.

    ``markov_w1``: W1 [V_target, r], indexed by the previous token's TARGET id (the anchor may be any
    target token). ``markov_w2``: W2 [V_draft, r], applied through ``LogitsProcessor``.
    vanilla: ``B_k = W2 W1[x_{k-1}]``.
    gated: ``g = sigmoid(gate_proj([h_k; W1[x_{k-1}]]))``, ``B_k = W2 (g * W1[x_{k-1}])``.
    rnn: ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``, ``joint_proj(z_k)`` split in (gate, candidate, output),
    ``s_k = sigmoid(gate) * s_{k-1} + (1 - sigmoid(gate)) * tanh(candidate)``, ``s_0 = 0``,
    ``B_k = W2 tanh(output)`` (position k reads s_{k-1}).

    ``replicate=True`` (default): W1 is a plain ``nn.Embedding`` and W2 a ``ParallelLMHead(...,
    disable_tp=True)``: full weights on every rank, no collective per position. ``replicate=False``:
    W1 ``VocabParallelEmbedding`` (an all-reduce per lookup) and W2 a sharded ``ParallelLMHead`` (a
    gather per position) over ``tp``.
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 head_type: str = "vanilla", tp: TPGroup | None = None, replicate: bool = True, dtype=torch.float32):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov_rank must be > 0, got {rank}")
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, got {head_type!r}")
        tp = tp or TPGroup()
        self.vocab_size, self.draft_vocab_size = vocab_size, draft_vocab_size
        self.rank, self.hidden_size = rank, hidden_size
        self.head_type = head_type
        self.sharded = not replicate
        if replicate:
            self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype)
            self.markov_w1.weight.weight_loader = default_weight_loader
            self.markov_w2 = ParallelLMHead(draft_vocab_size, rank, tp, disable_tp=True, dtype=dtype)
        else:
            self.markov_w1 = VocabParallelEmbedding(vocab_size, rank, tp, dtype=dtype)
            self.markov_w2 = ParallelLMHead(draft_vocab_size, rank, tp, dtype=dtype)
        self.logits_processor = LogitsProcessor(draft_vocab_size)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank, dtype=dtype)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, dtype=dtype)
        self.search_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # ``pack_for_search``

    @torch.no_grad()
    def pack_for_search(self, to_target: torch.Tensor | None = None) -> None:
        """For inference: the weights of the C++ tree search (``drafting.draft_trees`` through
        ``cpu_ops.tree_search``, a vanilla head kept whole): W1's rows of the draft vocabulary (``to_target``:
        each draft id's target id; None: the same vocabulary) and W2 in blocks of 16 draft ids, [ceil(V /
        16), r, 16], or for bfloat16 weights of an even rank its columns in pairs, [ceil(V / 16), r / 2, 16, 2]
        (what ``vdpbf16ps`` reads), copies taken now (call before the head's weights are quantized)."""
        dtype = self.markov_w2.weight.dtype
        if self.head_type != "vanilla" or self.sharded or dtype not in (torch.float32, torch.bfloat16):
            return  # (the op reads float32 or bfloat16 weights)
        V, r = self.draft_vocab_size, self.rank
        w1 = self.markov_w1.weight.detach()
        w1d = (w1[:V] if to_target is None else w1[to_target.to(w1.device)]).contiguous()
        w2 = self.markov_w2.weight.detach()[:V]
        Vp = (V + 15) // 16 * 16
        w2 = torch.cat([w2, w2.new_zeros(Vp - V, r)]) if Vp > V else w2
        if dtype == torch.bfloat16 and r % 2 == 0:
            w2 = w2.reshape(Vp // 16, 16, r // 2, 2).transpose(1, 2)
        else:
            w2 = w2.reshape(Vp // 16, 16, r).transpose(1, 2)
        self.search_pack = (w1d, w2.contiguous())

    def prev_embeddings(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """W1[x] for target-vocab ids [...] -> [..., r]."""
        return self.markov_w1(prev_token_ids.long())

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """W2 latent: [..., r] -> [..., V_draft] (gathered only when W2 is really sharded)."""
        return self.logits_processor(self.markov_w2, latent)

    def step(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor | None = None,
             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One position of the serial loop: prev ids [N] (target vocab), hidden [N, d] (the draft
        slot's final-normed state; gated/rnn only), state [N, r] (rnn; None = s_0 = 0)
        -> (bias [N, V_draft], new state (rnn) or None, W1[x] [N, r])."""
        emb = self.prev_embeddings(prev_token_ids)
        if self.head_type == "vanilla":
            return self.project(emb), None, emb
        if hidden is None:
            raise ValueError(f"the {self.head_type} Markov head needs the draft hidden states")
        hidden = hidden.to(emb.dtype)
        if self.head_type == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
            return self.project(g * emb), None, emb
        if state is None:
            state = emb.new_zeros(emb.shape)
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        new_state = g * state + (1.0 - g) * torch.tanh(cand)
        return self.project(torch.tanh(out)), new_state, emb

    def bias(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced bias of a whole block: prev ids [..., K] (``[anchor, x_1 .. x_{K-1}]``, target
        vocab), hidden [..., K, d] (gated/rnn) -> [..., K, V_draft]. vanilla and gated are computed for
        all positions at once; rnn is unrolled over K from s_0 = 0."""
        if self.head_type != "rnn":
            return self.step(prev_token_ids, hidden)[0]
        if hidden is None:
            raise ValueError("the rnn Markov head needs the draft hidden states")
        state, outs = None, []
        for k in range(prev_token_ids.shape[-1]):
            b, state, _ = self.step(prev_token_ids[..., k], hidden[..., k, :], state)
            outs.append(b)
        return torch.stack(outs, dim=-2)


class ConfidenceHead(nn.Module):
    """Acceptance-probability predictor: ``c_k = sigmoid(proj([h_k; W1[x_{k-1}]]))`` (``proj`` a
    ``Linear(d + r -> 1)`` with bias), or ``sigmoid(proj(h_k))`` when ``with_markov`` is False."""

    def __init__(self, hidden_size: int, markov_rank: int = 0, with_markov: bool = False, dtype=torch.float32):
        super().__init__()
        if with_markov and markov_rank <= 0:
            raise ValueError("a confidence head with_markov needs markov_rank > 0")
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1, dtype=dtype)

    def logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., d], prev_emb [..., r] (W1[x_{k-1}], with_markov only) -> [...] logits."""
        if self.with_markov:
            if prev_emb is None:
                raise ValueError("this confidence head reads W1[x_{k-1}]: pass prev_emb")
            hidden = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logits(hidden, prev_emb))

    _search = None  # ``search_weights``: (the weights' versions, then what it returns)

    def search_weights(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the C++ tree search reads, float32: the projection's hidden part [d], its bias [1] and its
        W1 part [rank] (zeros without ``with_markov``); made again only when the weights change."""
        key = (self.proj.weight._version, self.proj.bias._version, rank)
        if self._search is None or self._search[0] != key:
            w = self.proj.weight.detach().float()[0]
            d = w.numel() - (rank if self.with_markov else 0)
            we = w[d:].clone() if self.with_markov else w.new_zeros(rank)
            self._search = (key, w[:d].clone(), self.proj.bias.detach().float().clone(), we)
        return self._search[1:]
