"""Medusa drafting: chain (argmax of each head, vLLM style) or tree (top-k of each head arranged as a
Medusa tree, verified with tree attention). Both verify losslessly by default; Medusa's "typical
acceptance" is available opt-in and is lossy. Heads with ``token_input`` also read the target's embedding
of each request's last output token (the root of its step's tree).

speculative_config keys: ``model`` (a Medusa checkpoint; default: the heads shipped for the default
model), ``num_speculative_tokens`` (chain length, <= the number of heads), ``medusa_tree``: None
(chain), ``"auto"`` (tree size chosen from a step-cost curve measured on this device at start-up),
an int (a tree of that many nodes) or a list of Medusa rank paths; ``medusa_topk`` (candidates per
head, default 10); ``acceptance``: ``"exact"`` (default, lossless) or ``"typical"`` (lossy) with
``posterior_threshold`` (epsilon, default 0.09) and ``posterior_alpha`` (delta, default 0.3);
``medusa_verify``: ``"full"`` (default: every head's draft, every node of the tree is verified) or
``"auto"``: each step, every request verifies the part of its drafts that maximises expected tokens
per second, from the target's verify cost per token count measured at start-up
(``cost_model.choose_verify_lengths``, as DSpark's ``"auto"``) and the heads' probabilities at the
request's temperature (temperature 1 for greedy requests):

- chains are cut to a length, by the survival products of the drafts' confidences (the probability
  each head gives its drafted token);
- trees (``medusa_tree`` set; ``"auto"`` gives a candidate tree of ``max(TREE_SIZES)`` nodes) become
  dynamic: every candidate path is scored by the product of the probabilities its heads give its
  tokens this step, and each request verifies its highest-scoring paths (a subtree: a path never
  scores above its parent), as many as the cost model finds worth it.

With dynamic trees a request whose last drafting step did not pay for the heads' time sits drafting out
for a few steps (``draft_gate``, default True: ``cost_model.DraftGate``, as DSpark's); those steps still
verify the n-gram branches worth it.

Either way the predicted acceptance is first corrected online (``online_calibration``, default True:
``cost_model.AcceptanceCalibration``) by how often earlier steps with the same sampling settings
accepted what it predicted: heads fitted on greedy data overestimate acceptance at temperature > 0.
The choice reads the heads' outputs and earlier steps' outcomes only, never the target's verdict on
the drafts it chooses, and the drafts are verified exactly as a fixed chain or tree would be: lossless.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from specserve.layers import cpu_ops
from specserve.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.packing import pack_linears
from specserve.sample.sampler import inverse_cdf, uniforms
from specserve.sample.tree import TreeBuffers, TreeCache, tree_tokens_from_candidates
from specserve.spec_decode.cost_model import (
    TREE_SIZES,
    DraftGate,
    calibrated_lengths,
    calibration_factors,
    interp_cost,
    profile_sizes,
    ranked_scores,
    tree_profile_sizes,
)
from specserve.spec_decode.medusa.config import MedusaOptions
from specserve.spec_decode.medusa.formats import load_medusa_checkpoint
from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads
from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.proposer import Proposal, ProposeInputs, TreeDraft
from specserve.spec_decode.tree_select import merge_branches, unsorted

log = logging.getLogger("specserve.medusa")

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "medusa-smollm2-135m"
SUBTREE_CACHE = 4096  # dynamic trees: built subtrees kept for reuse
TEMPERATURE_CACHE = 256  # batches' temperature tables kept
ROOT_EMBEDDINGS = 2048  # root tokens' embedding rows kept (``_root_embeddings``)


def default_head_accuracy(num_heads: int, topk: int) -> list[list[float]]:
    """Prior P(rank r of head h is the right token) when a checkpoint records none: roughly the
    Vicuna-7B figures of the Medusa repo (top-1 0.56, 0.32, 0.20, 0.15, ...; top-5 0.78, 0.56, ...)."""
    top1 = [0.56 * 0.6**h for h in range(num_heads)]
    return [[t * 0.45**r for r in range(topk)] for t in top1]


def greedy_tree(acc: list[list[float]], size: int) -> list[list[int]]:
    """The ``size``-node Medusa tree (root excluded) that maximises expected accepted length, built
    greedily: keep adding the rank path with the largest product of per-depth accuracies whose
    parent path is already in the tree. ``acc[h][r]``: P(head h's rank-r token is right)."""
    paths: list[tuple[int, ...]] = []
    frontier = {(r,): acc[0][r] for r in range(len(acc[0]))}
    while len(paths) < size and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        score = frontier.pop(best)
        paths.append(best)
        d = len(best)
        if d < len(acc):
            for r in range(len(acc[d])):
                frontier[best + (r,)] = score * acc[d][r]
    return [list(p) for p in paths]


def expected_tokens(paths: list[list[int]], acc: list[list[float]]) -> float:
    """Expected tokens per step of a tree: 1 (the target's own token) + sum over nodes of P(path)."""
    total = 1.0
    for p in paths:
        total += math.prod(acc[d][r] for d, r in enumerate(p))
    return total


class MedusaProposer(ModelDrafter):
    name = "medusa"
    needs_hidden = True

    Options = MedusaOptions

    def __init__(self, opts: MedusaOptions):
        super().__init__(opts.online_calibration)
        self.requested_k = opts.num_speculative_tokens
        self.model_path = Path(opts.model) if opts.model else SHIPPED_DIR
        if not self.model_path.exists():  # before any model (or tensor-parallel worker) loads
            raise FileNotFoundError(f"Medusa checkpoint not found: {self.model_path}")
        self.tree_spec = opts.medusa_tree
        self.topk = opts.medusa_topk
        self.acceptance = opts.acceptance
        self.verify_mode = opts.medusa_verify
        self.posterior_threshold = opts.posterior_threshold
        self.posterior_alpha = opts.posterior_alpha
        self.tree: TreeBuffers | None = None
        self._candidates: dict | None = None  # the dynamic tree mode's candidate paths (medusa_verify="auto")
        self._subtrees = TreeCache(self._subtree, SUBTREE_CACHE)
        self._hidden: dict[int, torch.Tensor] = {}
        self._temps: dict[tuple, torch.Tensor] = {}  # ``_temperatures`` by the batch's settings
        self._root_rows: dict[int, torch.Tensor] = {}  # ``_root_embeddings`` by token id
        self.use_draft_gate = opts.draft_gate  # dynamic trees: ``gate`` set in load_model, its calls timed
        if self.acceptance == "typical":
            self.lossy_verify = self._typical
            log.warning("Medusa typical acceptance is LOSSY: outputs no longer follow the target distribution "
                        "exactly (use acceptance='exact' for lossless decoding)")

    # ---- set-up ---------------------------------------------------------------------------------
    def load_model(self, target) -> None:
        tcfg = target.config
        cfg, sd = load_medusa_checkpoint(self.model_path, tcfg.hidden_size, tcfg.vocab_size)
        self.cfg: MedusaConfig = cfg
        self.heads = MedusaHeads(cfg, target.tp, dtype=target.dtype)
        self.heads.load_state(sd)
        self.heads.eval().requires_grad_(False)
        self.device = device = target.device
        self.heads.to(device)
        packed, quantized = getattr(target, "packed", False), bool(getattr(target, "quantization", None))
        if packed:  # own vocab projections oneDNN-packed, like the target's
            pack_linears(self.heads)
        if packed or quantized:
            # beside a quantized target the first blocks in 8 bits (the group kernel, AVX2 CPUs too,
            # where oneDNN does not pack bfloat16), else oneDNN bfloat16
            self.heads.pack_first_blocks(8 if quantized else None)
        self.target = target
        self.embed = target.embed_tokens  # token_input heads: the root tokens' embeddings
        if cfg.token_input and self.embed.tp_size > 1:  # replicated like the heads: no collective a step
            full = VocabParallelEmbedding(tcfg.vocab_size, tcfg.hidden_size, disable_tp=True, dtype=target.dtype)
            full.weight_loader(full.weight, target.full_embedding_weight())
            self.embed = full.to(device)
        self.lm_head: ParallelLMHead = target.lm_head
        if cfg.shared_lm_head and cfg.draft_vocab_size:
            # the draft vocabulary's rows of the target's lm_head, replicated (no gather), packed
            rows = self.heads.token_map
            sub = ParallelLMHead(rows.numel(), tcfg.hidden_size, disable_tp=True, dtype=target.dtype).to(device)
            if self.lm_head.tp_size == 1 and self.lm_head.quant is not None:
                sub.quant = self.lm_head.quant[rows]  # a quantized target's rows as they are (its kernel)
            else:
                chosen = (target.full_lm_head_weight()[rows] if self.lm_head.tp_size > 1
                          else self.lm_head.dense_rows(rows.to(self.lm_head.weight.device)))
                with torch.no_grad():
                    sub.weight.copy_(chosen.to(target.dtype))
            if getattr(target, "packed", False) or sub.quant is not None:
                sub.pack()
            if sub.qkernel is not None:  # the kernel holds the rows
                sub.weight.data, sub.quant = torch.empty(0, dtype=sub.weight.dtype), None
            self.lm_head = sub
        elif cfg.shared_lm_head and self.lm_head.tp_size > 1:
            # heads are small and replicated: give them a full copy of the lm_head, never a gather
            full = ParallelLMHead(tcfg.vocab_size, tcfg.hidden_size, disable_tp=True, dtype=target.dtype)
            full.weight_loader(full.weight, target.full_lm_head_weight())
            full.to(device)
            self.lm_head = full
        if cfg.head_vocab_size < self.topk:
            raise ValueError(f"medusa_topk ({self.topk}) exceeds the heads' draft vocabulary of {cfg.head_vocab_size}")
        k = self.requested_k or cfg.num_heads
        if k > cfg.num_heads:
            raise ValueError(f"num_speculative_tokens ({k}) exceeds the checkpoint's {cfg.num_heads} Medusa heads")
        self.num_speculative_tokens = k
        meta = self._checkpoint_meta()
        self.accuracy = self._head_accuracy(meta)
        temps = meta.get("head_temperatures") or []
        self.head_temperatures = torch.tensor(  # calibration of the heads' probabilities (1: none recorded)
            [float(temps[h]) if h < len(temps) and float(temps[h]) > 0 else 1.0 for h in range(cfg.num_heads)],
            device=device)
        self._temps.clear()
        self._root_rows.clear()
        self.tree = self._build_tree(target)
        if self.verify_mode == "auto":
            max_seqs = getattr(target, "max_num_seqs", 1)
            if self.tree is None:
                _, sizes = profile_sizes(max_seqs, self.num_speculative_tokens)
            else:
                self._candidates = self._candidate_index(self.tree, device)
                _, sizes = tree_profile_sizes(max_seqs, self.tree.num_nodes - 1)
                if self.use_draft_gate:
                    self.gate = DraftGate()
            self.measure_costs(target, sizes, self.num_speculative_tokens)

    def _checkpoint_meta(self) -> dict:
        f = self.model_path / "config.json"
        return json.loads(f.read_text()) if self.model_path.is_dir() and f.exists() else {}

    def _head_accuracy(self, meta: dict) -> list[list[float]]:
        """P(rank r of head h is right) from the checkpoint's recorded top-k accuracies (``meta``: its
        config.json), else a prior."""
        topk_acc = meta.get("heldout_topk_accuracy")  # [K][k]: cumulative top-(r+1) accuracy
        if topk_acc and len(topk_acc) >= self.cfg.num_heads:
            out = []
            for h in range(self.cfg.num_heads):
                cum = list(topk_acc[h])[: self.topk]
                per = [max(1e-4, cum[0])] + [max(1e-4, cum[r] - cum[r - 1]) for r in range(1, len(cum))]
                per += [per[-1] * 0.5 ** (i + 1) for i in range(self.topk - len(per))]
                out.append(per)
            return out
        return default_head_accuracy(self.cfg.num_heads, self.topk)

    def _build_tree(self, target) -> TreeBuffers | None:
        spec = self.tree_spec
        if spec is None or spec is False:
            return None
        acc = self.accuracy[: self.num_speculative_tokens]
        if isinstance(spec, (list, tuple)):
            paths = [list(p) for p in spec]
            depth = max(len(p) for p in paths)
            if depth > self.cfg.num_heads:
                raise ValueError(f"medusa_tree has depth {depth} but the checkpoint has {self.cfg.num_heads} heads")
        elif spec == "auto" and self.verify_mode == "auto":  # dynamic: the candidates of every step
            paths = greedy_tree(acc, TREE_SIZES[-1])
        elif spec == "auto":
            paths = self._auto_tree(target, acc)
        elif isinstance(spec, int) and spec >= 1:
            paths = greedy_tree(acc, spec)
        else:
            raise ValueError(f"medusa_tree must be None, 'auto', a node count or a list of rank paths; got {spec!r}")
        if paths is None:
            return None
        tree = TreeBuffers.from_rank_paths(paths, topk=self.topk)
        self.num_speculative_tokens = tree.max_depth
        log.info("Medusa tree: %d nodes, depth %d", tree.num_nodes - 1, tree.max_depth)
        return tree

    def _auto_tree(self, target, acc):
        """Choose the tree size from the measured cost of verifying N tokens on this device: the size
        maximising expected tokens per second. None means a chain beats every tree."""
        cost = target.step_costs([1] + [n + 1 for n in TREE_SIZES])
        self.tree_costs = cost  # (not ``step_costs``: the engine's own steps, ``ModelDrafter``)
        chain_k = self.num_speculative_tokens
        chain = [[0] * (d + 1) for d in range(chain_k)]
        best = (expected_tokens(chain, acc) / interp_cost(cost, chain_k + 1), None)
        for n in TREE_SIZES:
            paths = greedy_tree(acc, n)
            rate = expected_tokens(paths, acc) / interp_cost(cost, n + 1)
            if rate > best[0]:
                best = (rate, paths)
        self.auto_choice = "chain" if best[1] is None else f"tree of {len(best[1])} nodes"
        log.info("Medusa auto: %s (step costs %s)", self.auto_choice, {k: round(v * 1e3, 1) for k, v in cost.items()})
        return best[1]

    @staticmethod
    def _candidate_index(tree: TreeBuffers, device="cpu") -> dict:
        """The dynamic mode's candidate paths (``tree``'s rank paths, sorted by depth) as tensors: ``flat``
        [P, D] (each path's entry at each depth of a request's top-k table flattened to [D * topk]; past
        the path's end, the entry appended after the table: a 1.0 for its probability), ``depth`` [P]
        (and as a list), ``max_depth`` D, ``kids``: (parent path or -1, rank) -> path."""
        paths = tree.rank_paths
        D, k = max(len(p) for p in paths), tree.topk
        flat = torch.full((len(paths), D), D * k, dtype=torch.long)
        for i, p in enumerate(paths):
            flat[i, : len(p)] = torch.tensor([d * k + r for d, r in enumerate(p)], dtype=torch.long)
        depth = [len(p) for p in paths]
        # path i is the tree's node i + 1, so its parent path is the parent node's index - 1 (-1: the root)
        kids = {(tree.parents[i + 1] - 1, p[-1]): i for i, p in enumerate(paths)}
        return {"paths": paths, "flat": flat.to(device), "depth": torch.tensor(depth, device=device),
                "depth_list": depth, "max_depth": D, "kids": kids}

    def _probs(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """[B, k, V'] head logits -> the heads' probabilities at each request's temperature (1 for
        greedy requests), each head's logits also divided by its calibration temperature
        (``head_temperatures`` in the checkpoint's config.json, fitted on held-out data by
        ``specserve train medusa``; 1 when absent). They only decide what to verify."""
        t = self._temperatures(seqs, logits.shape[1], logits.device)
        return torch.softmax(logits.float() / t.unsqueeze(-1), dim=-1)

    def _top_probs(self, logits: torch.Tensor, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """``_probs``' ``medusa_topk`` largest probabilities of each head and their indices, [B, k, topk]
        each (one pass a head and request through ``cpu_ops.softmax_topk`` on CPU)."""
        B, K, V = logits.shape
        t = self._temperatures(seqs, K, logits.device)
        probs, idx = cpu_ops.softmax_topk(logits.reshape(B * K, V).float(), None, t.view(-1, 1, 1), self.topk)
        return probs.view(B, K, -1), idx.view(B, K, -1)

    def _temperatures(self, seqs, K: int, device) -> torch.Tensor:
        """[B, K]: each request's temperature (1 for greedy requests) times each of the first K heads'
        calibration temperature, what ``_probs`` and ``_top_probs`` divide the heads' logits by."""
        key = (tuple(1.0 if s.params.greedy else float(s.params.temperature) for s in seqs), K)
        t = self._temps.get(key)
        if t is None:  # a batch's settings recur step after step: made once
            t = torch.tensor(key[0], device=device).view(-1, 1) * self.head_temperatures[:K].view(1, -1)
            if len(self._temps) >= TEMPERATURE_CACHE:
                self._temps.clear()
            self._temps[key] = t
        return t

    def path_probs(self, top_probs: torch.Tensor) -> torch.Tensor:
        """Dynamic trees: ``top_probs`` [B, D, topk] (each head's top-k probabilities, rank order) ->
        [B, P]: the product of the probabilities its heads give each candidate path's tokens."""
        c = self._candidates
        B, D = top_probs.shape[0], c["max_depth"]
        table = torch.cat([top_probs[:, :D].reshape(B, -1), top_probs.new_ones(B, 1)], dim=1)
        per_depth = table[:, c["flat"]]  # [B, P, D]
        out = per_depth[..., 0]
        for d in range(1, D):  # depth by depth, in order
            out = out * per_depth[..., d]
        return out

    def path_scores(self, probs: torch.Tensor, max_drafts: list[int], seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic trees: ``probs`` [B, P] (``path_probs``) -> (scores [B, P], order [B, P]): each
        request's candidate paths by decreasing score, ``probs`` scaled by the online calibration of
        the request's sampling settings (when it is on; this starts its step); paths deeper than the
        request's ``max_drafts`` score -1. Equal scores keep depth order, so every prefix of the first
        n paths is among them (a path never scores above its parent): each is a subtree."""
        return ranked_scores(self.calibration, seqs, probs, self._candidates["depth"], max_drafts)

    def ranked_paths(self, logits: torch.Tensor, seqs, max_drafts: list[int]) -> tuple[list, list, list, list]:
        """Dynamic trees: the heads' logits [B, K, V'] -> per request, as lists: its heads' top-k tokens
        [D * topk] (target ids, rank order), each candidate path's probability (``path_probs``), and
        ``path_scores``' ranking of those with its order (this starts the calibration's step). One call of
        the C++ op on CPU (``cpu_ops``: the same values), else ``_top_probs``, ``path_probs`` and
        ``path_scores``: fewer distinct calls matter here, as the target's forward has just evicted
        what they would touch from the caches."""
        c = self._candidates
        D = c["max_depth"]
        ops = cpu_ops.active() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if ops is not None:
            return ops.medusa_paths(logits, self._temperatures(seqs, D, logits.device), self.topk,
                                    self.heads.token_map, c["flat"], c["depth"],
                                    calibration_factors(self.calibration, seqs), list(max_drafts))
        top_p, top_i = self._top_probs(logits[:, :D], seqs)
        top = self.heads.to_target(top_i).reshape(len(seqs), -1).tolist()  # [B, D * topk] target ids
        raw = self.path_probs(top_p)
        score, order = self.path_scores(raw, max_drafts, seqs)
        return top, raw.tolist(), score.tolist(), order.tolist()

    def _subtree(self, idx: tuple[int, ...]) -> tuple[TreeBuffers, list[int]]:
        """The tree of the candidate paths ``idx`` (sorted), and its ``tree_indices`` as a list."""
        buf = TreeBuffers.from_rank_paths([self._candidates["paths"][i] for i in idx], topk=self.topk)
        return buf, buf.tree_indices.tolist()

    @property
    def plans_branches(self) -> bool:
        """Dynamic trees weigh the n-gram branch tokens (``ngram.branches``) with their own candidates."""
        return self._candidates is not None

    def _propose_gated(self, inputs: ProposeInputs) -> Proposal:
        """Dynamic trees for the requests the draft gate lets draft (all of them without a gate); the
        others verify the n-gram branches worth it alone. The gate then weighs each drafting request's
        step: the calibrated acceptance of the heads' nodes it verifies against this call's time."""
        seqs = inputs.seqs
        rows = [b for b, s in enumerate(seqs)
                if inputs.max_drafts[b] > 0 and (self.gate is None or not self.gate.skip(s.seq_id))]
        out = Proposal([[] for _ in seqs], trees=[None] * len(seqs), own_nodes=[None] * len(seqs))
        if rows:
            sub = [seqs[b] for b in rows]
            branches = [inputs.branches[b] for b in rows] if inputs.branches else None
            t0 = time.perf_counter()
            logits = self.heads.logits(torch.stack([self._hidden[s.seq_id] for s in sub]), self.lm_head,
                                       self._root_embeddings(sub))
            prop, gains = self._propose_dynamic(logits, sub, [inputs.max_drafts[b] for b in rows], branches)
            draft_s = time.perf_counter() - t0
            for r, b in enumerate(rows):
                out.trees[b], out.own_nodes[b] = prop.trees[r], prop.own_nodes[r]
            if self.gate is not None:
                self.drafting.observe(len(rows), draft_s)
                for s, (expected, n) in zip(sub, gains):
                    self._judge(s, expected, n, draft_s, len(rows))
        return self.add_branch_only_trees(seqs, out, inputs.branches, set(rows))

    def _propose_dynamic(self, logits: torch.Tensor, seqs, max_drafts: list[int],
                         branches=None) -> tuple[Proposal, list[tuple[float, int]]]:
        """The requests' dynamic trees, and per request (the expected acceptance, the count) of the heads'
        own nodes it verifies (a node that only an n-gram branch offers needs no drafting)."""
        c = self._candidates
        top, raw, score, order = self.ranked_paths(logits, seqs, max_drafts)
        branches = branches or [None] * len(seqs)
        items = [self._merge_branches(top[b], score[b], order[b], br) if br else None
                 for b, br in enumerate(branches)]
        surv = [[x for x in row if x >= 0.0] if it is None else [x[0] for x in it] for row, it in zip(score, items)]
        counts = self.verify_counts(surv)
        trees: list[TreeDraft | None] = []
        own: list[int | None] = []
        gains: list[tuple[float, int]] = []
        for b, (s, n) in enumerate(zip(seqs, counts)):
            idx, extra = self.take_nodes(s, items[b], n, order[b][:n], raw[b], c["depth_list"])
            picked = surv[b][:n] if items[b] is None else [it[0] for it in items[b][:n] if it[2] == 0]
            gains.append((sum(picked), len(idx)))
            tree = None
            if idx:
                buf, where = self._subtrees.get(tuple(idx))
                cand = [s.output_ids[-1]] + top[b]  # what ``tree_tokens_from_candidates`` indexes
                tree = TreeDraft([cand[i] for i in where], buf)
            tree, n_own = self.with_branches(tree, s, extra)
            trees.append(tree)
            own.append(n_own)
        return Proposal([[] for _ in seqs], trees=trees, own_nodes=own), gains

    def _merge_branches(self, top: list[int], ranked: list[float], order: list[int], branches) -> list[tuple]:
        """One request's candidate paths (``top`` [D * topk] its heads' tokens; ``ranked``/``order`` from
        ``path_scores``) and n-gram branches as ``tree_select.merge_branches`` items."""
        c, k = self._candidates, self.topk
        depth, kids = c["depth_list"], c["kids"]
        ranks: dict[int, dict[int, int]] = {}  # depth -> {token: its rank}, made when a branch gets there

        def child(node: int, token: int) -> int | None:
            d = depth[node] if node >= 0 else 0
            if d >= c["max_depth"]:
                return None
            if d not in ranks:
                ranks[d] = {t: r for r, t in enumerate(top[d * k : (d + 1) * k])}
            return kids.get((node, ranks[d].get(token)))

        return merge_branches(child, depth, unsorted(ranked, order), branches)

    def _typical(self, tokens, logits, tree, params, generator):
        return verify_typical(tokens, logits, tree, params.temperature, generator, self.posterior_threshold,
                              self.posterior_alpha)

    def dummy_run(self, batch_size: int = 1) -> None:
        d = self.cfg.hidden_size
        with torch.inference_mode():
            x = torch.zeros(batch_size, d, dtype=self.target.dtype, device=self.device)
            self.heads.logits(x, self.lm_head, x if self.cfg.token_input else None)

    def _root_embeddings(self, seqs) -> torch.Tensor | None:
        """[B, d]: the target's embedding of each request's last output token (the root of its step's
        tree, emitted from the hidden state the heads read) for ``token_input`` heads; else None. Each
        token's row is looked up once and kept (``ROOT_EMBEDDINGS`` of them; a quantized table's lookup
        is several small ops a step, and a few hundred tokens make most of any text)."""
        if not self.cfg.token_input:
            return None
        rows = []
        for s in seqs:
            tok = s.output_ids[-1]
            row = self._root_rows.get(tok)
            if row is None:
                if len(self._root_rows) >= ROOT_EMBEDDINGS:
                    self._root_rows.clear()
                ids = torch.tensor([tok], dtype=torch.long, device=self.device)
                row = self._root_rows[tok] = self.embed(ids)[0]  # in the target's dtype, as the hidden states
            rows.append(row)
        return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)

    # ---- per step -------------------------------------------------------------------------------
    def observe(self, seq, last_hidden, aux, reset) -> None:
        if last_hidden is not None:
            self._hidden[seq.seq_id] = last_hidden

    def forget(self, seq) -> None:
        self._hidden.pop(seq.seq_id, None)
        super().forget(seq)

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> Proposal:
        seqs = inputs.seqs
        if self._candidates is not None:
            return self._propose_gated(inputs)
        hidden = torch.stack([self._hidden[s.seq_id] for s in seqs])
        logits = self.heads.logits(hidden, self.lm_head, self._root_embeddings(seqs))  # [B, K, V'] (V': draft vocab)
        if self.tree is None:
            chain = logits[:, : self.num_speculative_tokens]
            drafts = self.heads.to_target(chain.argmax(-1)).tolist()
            limits = list(inputs.max_drafts)
            if self.verify_mode == "auto":
                surv = torch.cumprod(self._probs(chain, seqs).amax(-1), dim=1).tolist()
                limits, _ = calibrated_lengths(self.calibration, seqs,
                                               [row[: max(0, m)] for row, m in zip(surv, limits)], self.verify_cost)
            return Proposal([d[:m] for d, m in zip(drafts, limits)])
        K = self.tree.max_depth
        top = self.heads.to_target(logits[:, :K].topk(self.topk, dim=-1).indices)  # [B, K, topk] target ids
        trees, chains = [], []
        for b, (s, m) in enumerate(zip(seqs, inputs.max_drafts)):
            if m < K:  # near max_tokens: a short chain instead of the whole tree
                trees.append(None)
                chains.append(top[b, :m, 0].tolist())
                continue
            toks = tree_tokens_from_candidates(s.output_ids[-1], top[b], self.tree).tolist()
            trees.append(TreeDraft(toks, self.tree))
            chains.append([])
        return Proposal(chains, trees=trees)


def verify_typical(tokens: list[int], logits: torch.Tensor, tree: TreeBuffers, temperature: float,
                   generator: torch.Generator, eps: float, delta: float) -> tuple[list[int], int]:
    """Medusa's typical acceptance (LOSSY): a node is accepted when its token's probability under
    the target at its parent exceeds ``min(eps, delta * exp(-H(parent)))`` and its parent was
    accepted; the deepest accepted node wins (ties: the larger sum of log-probabilities); the extra
    token is sampled from the target at that node."""
    p = (logits.float() / max(temperature, 1e-5)).softmax(-1)
    ent = -(p * p.clamp_min(1e-20).log()).sum(-1)
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent)).tolist()
    logp = p.clamp_min(1e-20).log()
    ok, score = [True], [0.0]
    best = 0
    for i in range(1, tree.num_nodes):
        par = tree.parents[i]
        pi = float(p[par, tokens[i]])
        ok.append(ok[par] and pi > thresh[par])
        score.append(score[par] + float(logp[par, tokens[i]]))
        if ok[i] and (tree._depth_list[i], score[i]) > (tree._depth_list[best], score[best]):
            best = i
    return tree.path_to(best), int(inverse_cdf(p[best], uniforms(1, generator)[0]))

