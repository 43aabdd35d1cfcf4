"""DSpark / DFlash drafting: a block drafter conditioned on target hidden states of several layers
(KV injection), with DSpark's Markov head correcting each draft by the one chosen before it.

speculative_config keys: ``model`` (a DeepSpec, speculators or z-lab checkpoint; default: the drafter
shipped for the default model in ``specserve/checkpoints/{dspark,dflash}-smollm2-135m``),
``num_speculative_tokens`` (<= the block's drafts), ``draft_sample_method``: ``"greedy"`` (argmax of
the Markov-corrected logits, verified with the one-hot rule) or ``"probabilistic"`` (each draft sampled
from the corrected distribution at the request's temperature, its exact q kept for rejection
sampling), ``dspark_verify``:

* ``"full"``: verify every draft;
* ``"threshold"``: verify up to the first draft whose (calibrated) confidence is below
  ``confidence_threshold``;
* ``"auto"``: the cost model: target verification cost per total token count and drafting cost per
  batch size are measured at start-up on the running device (the drafting cost raised to the engine's
  own drafting calls' running mean once it is above: ``cost_model.DraftCosts``); each step every
  request's verify length is chosen to maximise expected accepted tokens per second of verification
  from the survival products of its confidences (``specserve.spec_decode.cost_model.choose_verify_lengths``;
  the drafting time, spent by then, is the draft gate's to weigh).

``dspark_tree`` (default None: a chain) drafts a tree instead, verified with tree attention
(``specserve.sample.tree``): the block forward gives each depth its base logits once, and every
branch gets the Markov bias of its own previous token (``drafting.draft_trees``): depth 1 holds
the ``dspark_tree_topk`` (default 4) best tokens, each further depth the ``dspark_tree_topk`` children
of the ``dspark_tree_beam`` (default 4) best nodes of the depth before. Each node is scored by the
estimated probability that its whole path is accepted (calibrated confidences for greedy requests,
draft probabilities at the request's temperature otherwise) and each request verifies its best
nodes (always a subtree): ``dspark_tree`` an int verifies that many, ``"auto"`` as many as the cost
model finds worth it (up to ``TREE_MAX_NODES``), per request and step.

In both "auto" modes the predicted acceptance is first corrected online (``online_calibration``,
default True: ``cost_model.AcceptanceCalibration``) by how often earlier steps with the same sampling
settings accepted what it predicted (a confidence head fitted on greedy data overestimates acceptance
at temperature > 0).

They also skip drafting for a request for a few steps when its last drafting step did not pay for
its drafting time (``draft_gate``, default True: ``cost_model.DraftGate``).

The cut depends on the drafter's confidences and earlier steps' outcomes only, never on whether this
step's drafts will be accepted, so every mode is lossless, at any temperature (trees too: they are
verified by ``verify_tree_greedy`` / ``verify_tree_sample``). ``markov_replicate`` (default True)
keeps the Markov head whole on every tensor-parallel rank (no collective per draft position); False
shards it (for comparison).

A batch drafts in one block forward: the sequences' contexts are padded and masked, the base logits are
one GEMM, the Markov loop runs over the batch. The worker fuses the drafter's projections for inference
(``DFlashDrafter.fuse_projections``: fewer, larger GEMMs, the same drafts). Under tensor parallelism the
drafter runs on every rank (``DSparkDraftWorker``, attached to each rank's ``ModelRunner``): the block
embedding uses the target's vocab-parallel embedding (one all-reduce) and the base logits its sharded
lm_head (one gather) unless the drafter has its own pruned-vocabulary head (replicated, no gather).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from specserve.device import DTYPES, synchronize
from specserve.layers import linear
from specserve.layers.linear import PackedGEMM, mkldnn_packing_available
from specserve.layers.packing import pack_linears
from specserve.layers.quant import quantize
from specserve.sample.tree import TreeBuffers, TreeCache
from specserve.spec_decode.cost_model import (
    DraftGate,
    calibrated_lengths,
    profile_sizes,
    ranked_scores,
    tree_profile_sizes,
)
from specserve.spec_decode.dspark.config import DSparkOptions
from specserve.spec_decode.dspark.drafting import calibrate_confidences, draft_target_ids
from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
from specserve.spec_decode.dspark.model import DFlashDrafter
from specserve.spec_decode.model_drafter import ModelDrafter
from specserve.spec_decode.proposer import Proposal, ProposeInputs, TreeDraft
from specserve.spec_decode.tree_select import merge_branches, unsorted

log = logging.getLogger("specserve.dspark")

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "checkpoints"
PROFILE_CONTEXT = 128  # context length of the start-up cost measurements
LONG_DRAFT_BATCH = 4  # the start-up times larger drafting batches once (``time_drafting``)
TREE_MAX_NODES = 64  # dspark_tree="auto": the most nodes one request's tree may verify


def resolve_draft_dtype(draft_dtype: str, target_dtype: torch.dtype, device, state: dict) -> torch.dtype:
    """The dtype the drafter runs in. ``"auto"``: bfloat16 when the checkpoint stores its weights in
    bfloat16 (the shipped drafters do) and the device runs bfloat16 GEMMs fast (``fast_bfloat16``), since
    running them in float32 adds bytes, not precision; else the target's dtype. The drafter only proposes
    and the target verifies every token, so its dtype moves acceptance, never the output."""
    if draft_dtype != "auto":
        return DTYPES[draft_dtype]
    stored = {t.dtype for t in state.values() if t.is_floating_point()}
    return torch.bfloat16 if stored == {torch.bfloat16} and linear.fast_bfloat16(device) else target_dtype


def resolve_draft_quantization(draft_quantization: str, runner) -> str | None:
    """The weight-only quantization of the drafter's linears and heads (``layers.quant``, groups of 32
    columns). ``"auto"``: 8 bits when the target runs quantized (CPU), else none. The drafter only
    proposes and the target verifies every token, so this moves acceptance and draft time, never the
    output."""
    if draft_quantization == "auto":
        return "int8" if getattr(runner, "quantization", None) else None
    if draft_quantization != "none" and getattr(runner, "device", "cpu") != "cpu":
        raise ValueError(f"draft_quantization={draft_quantization!r} runs on the CPU only; use 'none'")
    return None if draft_quantization == "none" else draft_quantization


def quantize_drafter(drafter: torch.nn.Module, scheme: str) -> None:
    """Replace the weight of every linear and LM head of ``drafter`` (fused projections included; the
    embeddings stay dense: a lookup reads a few rows) by its ``scheme`` quantization in groups of 32
    columns, run by the weight-only kernels of ``layers.quant``; the float weights are freed. A layer
    whose input size is not a multiple of 32 (a small Markov rank) stays dense."""
    bits = {"int8": 8, "int4": 4}[scheme]
    gemms = [m for m in drafter.modules()
             if isinstance(m, PackedGEMM) and m.weight.numel() and m.weight.shape[1] % 32 == 0]
    for m in gemms:
        m.quant = quantize(m.weight.data, bits, 32, f"{scheme}-g32")
    pack_linears(drafter)
    for m in gemms:
        m.weight.data = torch.empty(0, dtype=m.weight.dtype)


def _generator(state):
    if state is None:
        return None
    g = torch.Generator()
    g.set_state(state)
    return g


MAX_WAITING_POSITIONS = 64  # target features a sequence keeps unprojected at most (memory)


class DSparkDraftWorker:
    """The drafter on one rank, next to that rank's ``ModelRunner``: the weights, one ``DraftCache``
    per running sequence, and batched drafting. Every rank gets the same calls with the same arguments
    (sampling generators travel as their states), so all ranks draft the same tokens and meet at the
    same collectives; only the driver's results are used. The target features of committed positions
    wait (``pending``) until the sequence drafts next: steps the cost model or the gate leave without
    drafts project nothing, and the wait projects them in one call."""

    def __init__(self, runner, model_path: str, markov_replicate: bool = True, draft_dtype: str = "auto",
                 draft_quantization: str = "auto"):
        cfg, sd = load_dspark_checkpoint(model_path, runner.config)
        self.cfg = cfg
        self.tp = runner.tp
        self.dtype = resolve_draft_dtype(draft_dtype, runner.dtype, runner.device, sd)
        self.drafter = DFlashDrafter(cfg, tp=runner.tp, dtype=self.dtype, markov_replicate=markov_replicate)
        self.drafter.load_state(sd)
        self.drafter.eval().requires_grad_(False)
        self.device = runner.device  # the target's: its embedding, lm_head and features
        self.drafter.to(self.device)
        self.drafter.fuse_projections()
        self.quantization = resolve_draft_quantization(draft_quantization, runner)
        if self.quantization:
            quantize_drafter(self.drafter, self.quantization)
        elif getattr(runner, "packed", False) and mkldnn_packing_available(self.dtype):
            pack_linears(self.drafter)  # the target's linears are oneDNN-packed: the drafter's too
        self.embed = runner.embed_tokens
        target_logits, target_dtype = runner.compute_logits, runner.dtype
        # a drafter without its own lm_head reads the target's, in the target's dtype
        self.logits_fn = lambda h: target_logits(h.to(target_dtype))
        self.caches: dict[int, object] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}
        self._waiting: dict[int, int] = {}  # seq_id -> rows in ``pending``
        self.max_waiting = MAX_WAITING_POSITIONS

    @torch.inference_mode()
    def observe(self, seq_id: int, features, reset: bool) -> None:
        """Keep the target features of the positions now kept for ``seq_id`` (the cache holds the committed
        prefix, so they continue it; ``reset``: a new prompt starts at position 0) until it drafts: a list of
        the m feature layers' [n, d] tensors, joined only then (one join a drafting step, not one a decoding
        step), or one [n, m*d] numpy array (what crosses the pipe to the other ranks, plain bytes)."""
        if seq_id not in self.caches:
            self.caches[seq_id] = self.drafter.new_cache()
        if reset:
            self.caches[seq_id].reset()
            self.pending[seq_id], self._waiting[seq_id] = [], 0
        if isinstance(features, (list, tuple)):
            part = list(features)
        else:
            part = [torch.as_tensor(features, device=self.device)]
        self.pending.setdefault(seq_id, []).append(part)
        self._waiting[seq_id] = n = self._waiting.get(seq_id, 0) + part[0].shape[0]
        if n >= self.max_waiting:  # a sequence that long without drafts
            self.ready_caches([seq_id])

    @torch.inference_mode()
    def ready_caches(self, seq_ids) -> list:
        """The sequences' caches, their waiting features projected (one ``extend`` each)."""
        for i in seq_ids:
            parts = self.pending.pop(i, None)
            self._waiting.pop(i, None)
            if parts:
                cache = self.caches[i]
                if len({len(part) for part in parts}) == 1:  # each layer's rows joined, then the layers
                    layers = [col[0] if len(col) == 1 else torch.cat(col) for col in zip(*parts)]
                    features = layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1)
                else:  # joined and per-layer parts: each part joined first
                    features = torch.cat([part[0] if len(part) == 1 else torch.cat(part, dim=-1) for part in parts])
                start = len(cache)
                cache.extend(features, range(start, start + features.shape[0]))
        return [self.caches[i] for i in seq_ids]

    def forget(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self._waiting.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, seq_ids, anchors, starts, num_drafts: int, temperatures=None, gen_states=None):
        """One block per sequence, one forward. Returns (``DraftBlock`` with a batch dimension, the
        generators' states after sampling) on the driver, None elsewhere."""
        gens = [_generator(None if st is None else torch.as_tensor(st)) for st in (gen_states or [None] * len(seq_ids))]
        blk = self.drafter.propose_batch(anchors, starts, self.ready_caches(seq_ids), self.embed,
                                         self.logits_fn, temperatures, gens, num_drafts)
        if not self.tp.is_driver:
            return None
        return blk, [None if g is None else g.get_state() for g in gens]

    @torch.inference_mode()
    def propose_tree(self, seq_ids, anchors, starts, num_drafts: int, temperatures=None, topk: int = 4,
                     beam: int = 4, confidence_temperatures=None, min_score: float = 0.0):
        """Candidate draft trees, one per sequence, from one block forward (``DraftTree`` on the driver,
        None elsewhere); ``min_score``: ``draft_trees``'."""
        tree = self.drafter.propose_tree_batch(anchors, starts, self.ready_caches(seq_ids), self.embed,
                                               self.logits_fn, temperatures, num_drafts, topk, beam,
                                               confidence_temperatures, min_score)
        return tree if self.tp.is_driver else None

    @torch.inference_mode()
    def draft_step_collectives(self, batch: int = 2, context: int = 8) -> dict[str, int]:
        """The collectives this rank runs in one drafting step of ``batch`` placeholder sequences."""
        d = self.cfg.hidden_size * self.cfg.num_aux_layers
        ids = [-(i + 1) for i in range(batch)]
        for i in ids:
            self.observe(i, torch.zeros(context, d, device=self.device), reset=True)
        self.drafter.mask_row(self.embed)  # (looked up at the first step only)
        before = dict(self.tp.counts)
        self.propose(ids, [0] * batch, [context] * batch, self.cfg.num_drafts)
        out = {k: v - before.get(k, 0) for k, v in self.tp.counts.items() if v - before.get(k, 0)}
        for i in ids:
            self.forget(i)
        return out

    def markov_weight_shapes(self) -> dict[str, tuple]:
        """Shapes of this rank's Markov head weights (empty without a Markov head)."""
        mk = self.drafter.markov_head
        if mk is None:
            return {}
        return {"markov_w1": tuple(mk.markov_w1.weight.shape), "markov_w2": tuple(mk.markov_w2.weight.shape)}

    @torch.inference_mode()
    def time_drafting(self, batch_sizes, context: int = PROFILE_CONTEXT, reps: int = 3,
                      tree: tuple[int, int] | None = None, num_drafts: int | None = None) -> dict[int, float]:
        """Seconds of one drafting step for each batch size (median of ``reps``; one run above
        ``LONG_DRAFT_BATCH`` sequences, where a step is long and steady), over placeholder contexts of
        ``context`` positions (after an untimed run); ``tree``: (topk, beam) times tree drafting instead
        of a chain; ``num_drafts``: the drafts (tree depths) a step makes (default: the block's all)."""
        d = self.cfg.hidden_size * self.cfg.num_aux_layers
        g = self.cfg.num_drafts if num_drafts is None else int(num_drafts)
        out = {}
        for B in batch_sizes:
            ids = [-(i + 1) for i in range(B)]  # placeholder sequence ids
            for i in ids:
                self.observe(i, torch.zeros(context, d, device=self.device), reset=True)
            ts = []
            for _ in range((reps if B <= LONG_DRAFT_BATCH else 1) + 1):
                synchronize(self.device)
                t0 = time.perf_counter()
                if tree is None:
                    self.propose(ids, [0] * B, [context] * B, g)
                else:
                    self.propose_tree(ids, [0] * B, [context] * B, g, None, *tree)
                synchronize(self.device)
                ts.append(time.perf_counter() - t0)
            for i in ids:
                self.forget(i)
            ts = sorted(ts[1:])
            out[B] = ts[len(ts) // 2]
        return out


# drafting costs measured in this process (``DSparkProposer._profile``), by what decides them
_DRAFT_COSTS: dict[tuple, dict[int, float]] = {}


class DSparkProposer(ModelDrafter):
    name = "dspark"

    Options = DSparkOptions

    def __init__(self, opts: DSparkOptions):
        model = opts.model
        if model is None:
            model = SHIPPED_DIR / f"{self.name}-smollm2-135m"
            if not model.exists():
                raise ValueError(f"method {self.name!r} needs a drafter checkpoint: speculative_config['model'] "
                                 "(none is shipped for it)")
        super().__init__(opts.online_calibration)
        self.tree_size = opts.dspark_tree
        self.tree_topk, self.tree_beam = opts.dspark_tree_topk, opts.dspark_tree_beam
        self._trees = TreeCache(lambda parents: TreeBuffers.from_parents([-1, *parents]))
        self.model_path = Path(model)
        if not self.model_path.exists():  # before any model (or tensor-parallel worker) loads
            raise FileNotFoundError(f"{self.name} checkpoint not found: {self.model_path}")
        self.requested_k = opts.num_speculative_tokens
        self.sample_method = opts.draft_sample_method
        self.verify_mode = opts.dspark_verify
        self.threshold = float(opts.confidence_threshold)
        self.markov_replicate = opts.markov_replicate
        self.draft_dtype = opts.draft_dtype
        self.draft_quantization = opts.draft_quantization
        self.use_draft_gate = opts.draft_gate  # the "auto" modes: ``gate`` set in load_model

    def load_model(self, target) -> None:
        target.attach(self.name, DSparkDraftWorker, str(self.model_path), self.markov_replicate, self.draft_dtype,
                      self.draft_quantization)
        self.worker: DSparkDraftWorker = target.helper(self.name)
        cfg = self.worker.cfg
        k = self.requested_k or cfg.num_drafts
        if k > cfg.num_drafts:
            raise ValueError(f"num_speculative_tokens ({k}) exceeds the drafter's {cfg.num_drafts} drafts per block")
        if self.verify_mode != "full" and not cfg.enable_confidence_head:
            raise ValueError(f"dspark_verify={self.verify_mode!r} needs a confidence head; this checkpoint has none "
                             "(use 'full')")
        self.target = target
        self.cfg = cfg
        self.aux_layers = tuple(cfg.target_layer_ids)
        self.num_speculative_tokens = k
        conf = json.loads((self.model_path / "config.json").read_text()) if self.model_path.is_dir() else {}
        self.conf_temps = conf.get("confidence_temperatures")  # STS calibration, one per position
        self.vocab_size = target.config.vocab_size
        if self.verify_mode == "auto" or self.tree_size == "auto":
            self._profile(target)
            if self.use_draft_gate:
                self.gate = DraftGate()

    def _profile(self, target) -> None:
        """The cost tables of the "auto" modes, measured on the running device."""
        max_seqs = getattr(target, "max_num_seqs", 1)
        if self.tree_size == "auto":
            batch_sizes, sizes = tree_profile_sizes(max_seqs, TREE_MAX_NODES)
            tree = (self.tree_topk, self.tree_beam)
        else:
            (batch_sizes, sizes), tree = profile_sizes(max_seqs, self.num_speculative_tokens), None
        self.measure_costs(target, sizes, self.num_speculative_tokens)
        key = (*target.cost_key(), str(self.model_path), self.markov_replicate, self.draft_dtype,
               self.draft_quantization, tuple(batch_sizes), tree, self.num_speculative_tokens)
        if key not in _DRAFT_COSTS:  # once per process, as the target's step costs
            _DRAFT_COSTS[key] = target.call_helper(self.name, "time_drafting", batch_sizes, PROFILE_CONTEXT, 3, tree,
                                                   self.num_speculative_tokens)
        self.draft_costs = dict(_DRAFT_COSTS[key])
        log.info("%s auto: draft cost %s ms", self.name, {b: round(v * 1e3, 1) for b, v in self.draft_costs.items()})

    def draft_vocabulary(self) -> torch.Tensor | None:
        """The target ids the drafter can propose (its pruned head's vocabulary), or None for the
        target's whole vocabulary."""
        d2t = self.worker.drafter.d2t
        return None if d2t is None else draft_target_ids(d2t).cpu()

    def dummy_run(self, batch_size: int = 1) -> None:
        tree = None if self.tree_size is None else (self.tree_topk, self.tree_beam)
        self.target.call_helper(self.name, "time_drafting", [batch_size], 2, 1, tree, self.num_speculative_tokens)

    def observe(self, seq, last_hidden, aux, reset) -> None:
        feats = aux
        if self.target.tp.size > 1:  # plain bytes through the pipe, no shared-memory tensor handles
            feats = torch.cat(aux, dim=-1).float().cpu().numpy()
        self.target.call_helper(self.name, "observe", seq.seq_id, feats, reset)

    def forget(self, seq) -> None:
        self.target.call_helper(self.name, "forget", seq.seq_id)
        super().forget(seq)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        seqs = inputs.seqs
        budget = [max(0, min(m, self.num_speculative_tokens)) for m in inputs.max_drafts]
        rows = [b for b, k in enumerate(budget)
                if k > 0 and not (self.gate is not None and self.gate.skip(seqs[b].seq_id))]
        chains: list[list[int]] = [[] for _ in seqs]
        if self.tree_size is not None:
            prop = self._propose_trees(seqs, rows, budget, inputs.branches) if rows else Proposal(chains)
            return self.add_branch_only_trees(seqs, prop, inputs.branches, set(rows))
        if not rows:
            return Proposal(chains)
        probabilistic = self.sample_method == "probabilistic"
        temps, states = [], []
        for b in rows:
            s = seqs[b]
            t = s.params.temperature if probabilistic and not s.params.greedy else None
            temps.append(t)
            states.append(s.generator.get_state().numpy() if t is not None else None)
        t0 = time.perf_counter()
        blk, new_states = self.target.call_helper(
            self.name, "propose", [seqs[b].seq_id for b in rows], [seqs[b].output_ids[-1] for b in rows],
            [seqs[b].num_computed for b in rows], max(budget[b] for b in rows), temps, states)
        synchronize(blk.tokens.device)  # the drafter's GPU work is done, not just queued
        draft_s = time.perf_counter() - t0
        self.drafting.observe(len(rows), draft_s)
        for b, st in zip(rows, new_states):
            if st is not None:
                seqs[b].generator.set_state(st)
        tokens = blk.tokens.tolist()
        lengths = [budget[b] for b in rows]
        if self.verify_mode != "full" and blk.confidences is not None:
            conf = self._calibrated(blk.confidences)  # [R, g]
            if self.verify_mode == "threshold":
                below = (conf < self.threshold).tolist()
                lengths = [min(L, next((i for i, x in enumerate(row) if x), len(row)))
                           for L, row in zip(lengths, below)]
            else:
                surv = [row[:L] for row, L in zip(torch.cumprod(conf, dim=1).tolist(), lengths)]
                lengths, gains = calibrated_lengths(self.calibration, [seqs[b] for b in rows], surv, self.verify_cost)
                if self.gate is not None:
                    for b, gain, L in zip(rows, gains, lengths):
                        self._judge(seqs[b], gain, L, draft_s)
        for r, b in enumerate(rows):
            chains[b] = tokens[r][: lengths[r]]
        draft_probs = None
        if blk.probs is not None:
            K = max(len(c) for c in chains)
            draft_probs = torch.zeros(len(seqs), K, self.vocab_size, device=blk.probs.device)
            for r, b in enumerate(rows):
                L = len(chains[b])
                if temps[r] is not None and L:
                    draft_probs[b, :L] = blk.probs[r, :L].float()
        return Proposal(chains, draft_probs)

    @property
    def plans_branches(self) -> bool:
        """``dspark_tree: "auto"`` weighs the n-gram branch tokens (``ngram.branches``) with its own candidates."""
        return self.tree_size == "auto"

    def _propose_trees(self, seqs, rows: list[int], budget: list[int], branches=None) -> Proposal:
        """Each request's best candidate nodes as a tree: a fixed number (``dspark_tree`` an int) or as
        many as the cost model finds worth verifying (``"auto"``), then with the chosen nodes of its
        n-gram ``branches`` (``tree_select.merge_branches``) when they are offered."""
        temps = [None if seqs[b].params.greedy else float(seqs[b].params.temperature) for b in rows]
        # "auto": the search leaves out the nodes the cost model would not verify
        min_score = self.expand_threshold([seqs[b] for b in rows]) if self.tree_size == "auto" else 0.0
        t0 = time.perf_counter()
        cand = self.target.call_helper(
            self.name, "propose_tree", [seqs[b].seq_id for b in rows], [seqs[b].output_ids[-1] for b in rows],
            [seqs[b].num_computed for b in rows], max(budget[b] for b in rows), temps, self.tree_topk,
            self.tree_beam, self.conf_temps, min_score)
        synchronize(cand.scores.device)
        draft_s = time.perf_counter() - t0
        self.drafting.observe(len(rows), draft_s)
        # a node never scores above its parent, which comes first: every prefix of this order is a subtree
        ranked, order = ranked_scores(self.calibration, [seqs[b] for b in rows], cand.scores, cand.depth,
                                      [budget[b] for b in rows])
        order = order.cpu()  # read row by row below: one copy from a GPU, not one per row
        ranked = ranked.tolist()
        valid = [[x for x in row if x >= 0.0] for row in ranked]
        tokens, parents, depth = cand.tokens.tolist(), cand.parents.tolist(), cand.depth.cpu().tolist()
        items: list[list | None] = [None] * len(rows)
        if branches and self.tree_size == "auto":
            for r, b in enumerate(rows):
                if branches[b]:
                    kids = {(p, t): i for i, (t, p) in enumerate(zip(tokens[r], parents[r]))}
                    items[r] = merge_branches(lambda node, t, kids=kids: kids.get((node, t)), depth,
                                              unsorted(ranked[r], order[r].tolist()), branches[b])
                    valid[r] = [it[0] for it in items[r]]
        if self.tree_size == "auto":
            counts = self.verify_counts([v[:TREE_MAX_NODES] for v in valid])
            if self.gate is not None:  # what drafting adds: its own nodes (branch nodes need no drafting)
                for r, (b, v, n) in enumerate(zip(rows, valid, counts)):
                    own_v = v[:n] if items[r] is None else [it[0] for it in items[r][:n] if it[2] == 0]
                    self._judge(seqs[b], sum(own_v), len(own_v), draft_s)
        else:
            counts = [min(self.tree_size, len(v)) for v in valid]
        trees: list[TreeDraft | None] = [None] * len(seqs)
        own: list[int | None] = [None] * len(seqs)
        raw = cand.scores.cpu().tolist() if self.calibration is not None else [[]] * len(rows)
        for r, b in enumerate(rows):
            # the calibration checks the unscaled predictions; parents come first
            chosen, extra = self.take_nodes(seqs[b], items[r], counts[r], order[r, : counts[r]].tolist(), raw[r], depth)
            if chosen:
                node = {c: i + 1 for i, c in enumerate(chosen)}
                shape = tuple(0 if parents[r][c] < 0 else node[parents[r][c]] for c in chosen)
                trees[b] = TreeDraft([seqs[b].output_ids[-1]] + [tokens[r][c] for c in chosen], self._trees.get(shape))
            trees[b], own[b] = self.with_branches(trees[b], seqs[b], extra)
        return Proposal([[] for _ in seqs], trees=trees, own_nodes=own)

    def _calibrated(self, c: torch.Tensor) -> torch.Tensor:
        """Confidences [..., g] after the checkpoint's sequential temperature scaling (if it has one)."""
        return calibrate_confidences(c, self.conf_temps)


class DFlashProposer(DSparkProposer):
    """The same drafter without the Markov head (a ``markov_rank: 0`` checkpoint)."""

    name = "dflash"
