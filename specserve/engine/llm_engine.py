"""The engine loop: admit requests (``Scheduler``: slots, KV blocks, prefix caching), prefill them in
chunks, then run one speculative step per call:

    blocks reserved (or speculation backs off, or the newest sequence is preempted) ->
    proposer.propose -> runner.forward([last token + drafts] per sequence) -> rejection sampler or
    coupled verification (chains) or tree verifier (trees) -> append the accepted + recovered/bonus tokens

Plain decoding is the same loop with a proposer that proposes nothing. Running sequences occupy batch
rows (slots) 0..B-1, each with its block table in the paged KV cache (a finished one's slot is refilled
by moving the last sequence's table into it). Rejected drafts cost nothing to drop: a sequence's cache
length is just ``num_computed``, and blocks past it are given back at its next step."""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.model_runner import ModelRunner, TPRunner, resolve_device, resolve_quantization
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence
from specserve.models.loader import gguf_source, read_config, resolve_model_dir
from specserve.engine.verify import Drafts, Verifier, forward_inputs
from specserve.sample.tree import TreeBuffers, TreeCache
from specserve.spec_decode import ProposeInputs, TreeDraft, build_proposer
from specserve.spec_decode.metrics import SpecMetrics
from specserve.spec_decode.cost_model import sampling_key
from specserve.spec_decode.ngram import BranchAcceptance, NgramPool, graft, ngram_candidates
from specserve.tokenizer import Tokenizer


@dataclasses.dataclass
class EngineStats:
    """Counters since start-up. decode_s: whole decoding steps (decode_steps of them); draft_s: the
    drafter's part of them; verified_tokens: the tokens their target forwards ran (1 per sequence and
    step without drafts); prefix_cached_tokens: prompt positions taken from the prefix cache."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    draft_s: float = 0.0
    verified_tokens: int = 0
    ngram_branch_tokens: int = 0
    ngram_branch_wins: int = 0
    prefix_cached_tokens: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def path_tree(k: int) -> TreeBuffers:
    """A chain of k drafts as a tree (root + a path of k nodes)."""
    return TreeBuffers.from_parents([-1] + list(range(k)))


class LLMEngine:
    def __init__(self, model=None, cfg: EngineConfig | None = None, device: str | None = "auto"):
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_dir = resolve_model_dir(model)
        model_config = read_config(self.model_dir)  # an unsupported architecture is named before anything else
        if cfg.max_model_len is not None and cfg.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({cfg.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({model_config.max_position_embeddings})")
        self.max_model_len = cfg.max_model_len or model_config.max_position_embeddings
        if model_config.sliding_window:
            self.max_model_len = min(self.max_model_len, model_config.sliding_window)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.device = device = resolve_device(device, cfg.tensor_parallel_size)
        # the speculative configuration is checked before any model or worker process loads
        spec, self.branch_opts = split_ngram_branch(cfg.speculative)
        self.proposer = build_proposer(spec)
        if cfg.tensor_parallel_size > 1:
            if device != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs worker processes on CPU (gloo) only for now")
            # before any worker starts: what a sharded model can run (``resolve_quantization``)
            resolve_quantization(cfg.quantization, cfg.dtype, gguf_source(self.model_dir) is not None, device,
                                 cfg.tensor_parallel_size)
            self.runner = TPRunner(self.model_dir, cfg.tensor_parallel_size, cfg.dtype, cfg.max_num_seqs,
                                   cfg.num_threads, cfg.quantization, cfg.kv_cache_memory, self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_dir, None, cfg.dtype, device, cfg.max_num_seqs,
                                      quantization=cfg.quantization, kv_cache_memory=cfg.kv_cache_memory,
                                      max_model_len=self.max_model_len)
        try:
            self._set_up(cfg)
        except BaseException:  # no worker process outlives a failed start
            self.shutdown()
            raise

    def _set_up(self, cfg: EngineConfig) -> None:
        self.model_config = self.runner.config
        eos = list(self.tokenizer.eos_token_ids or [])
        cfg_eos = self.model_config.eos_token_id
        eos += [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
        self.eos_ids = list(dict.fromkeys(eos))
        self._branch_trees = TreeCache.by_parents()  # grafted shapes recur
        self.branch_acceptance = BranchAcceptance(self.ngram_branch) if self.ngram_branch else None
        self.ngram_pool = NgramPool() if self.ngram_branch and self.branch_opts.pool else None
        self.proposer.load_model(self.runner)
        self.runner.reset_kv()  # the blocks of the start-up measurements are given back
        self.metrics = SpecMetrics()
        self.scheduler = Scheduler(cfg.max_num_seqs, self.runner.kv.blocks)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running  # the same objects
        # prefix caching: not for drafters that keep the target's features of every position (the shared
        # positions are not recomputed, so their features would be missing)
        self.prefix_caching = cfg.enable_prefix_caching and not self.proposer.aux_layers
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self.verifier = Verifier(cfg.sampling_mode, self.proposer.lossy_verify, self.runner.compact)
        self.stats = EngineStats()

    # ---- requests -----------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise what ``add_request`` would raise for this request, queueing nothing."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not (0 <= int(t) < V)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        self.check_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        seq = Sequence(next(self._ids), prompt, prompt_ids, params, seed, self.tokenizer, self.eos_ids,
                       self.max_model_len)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.scheduler.prefilling:
            self.scheduler.prefilling.remove(seq)
            self._give_back(seq)
            seq._finish("abort")
        if seq in self.running:
            seq._finish("abort")
            self._free_finished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit what fits, compute one budget of prompt tokens (``_prefill_step``), then decode the
        running batch once. Returns the sequences that changed in this step (new tokens or finished)."""
        admitted = self.scheduler.admit()
        if self.prefix_caching:
            for seq in admitted:
                seq.num_computed = self.runner.share_prefix(seq.slot, self.scheduler.prefill_ids(seq))
                self.stats.prefix_cached_tokens += seq.num_computed
        touched = self._prefill_step()
        self._free_finished()
        if self.running:
            touched.extend(s for s in self.running if s not in touched)
            self._decode()
        self._free_finished()
        self.stats.steps += 1
        return touched

    def _prefill_step(self) -> list[Sequence]:
        """Compute at most ``prefill_chunk`` prompt tokens of the prefilling sequences, in admission
        order: short prompts that start from scratch on consecutive slots together in one forward, a
        long one (or one with a cached prefix) a chunk at a time. A sequence whose prompt is complete
        gets its first token (a recomputed one, with output already, decodes on from its last token)
        and joins the running batch. Returns the sequences that joined."""
        t0 = time.perf_counter()
        sched, budget, joined = self.scheduler, self.cfg.prefill_chunk, []
        while budget > 0 and sched.prefilling:
            head = sched.prefilling[0]
            ids = sched.prefill_ids(head)
            begin = head.num_computed
            group = [head]
            if begin == 0 and len(ids) <= budget:  # whole short prompts on consecutive slots: one forward
                total = len(ids)
                for s in sched.prefilling[1:]:
                    n = len(sched.prefill_ids(s))
                    if s.num_computed or s.slot != group[-1].slot + 1 or total + n > budget:
                        break
                    group.append(s)
                    total += n
            group_ids = [ids] + [sched.prefill_ids(s) for s in group[1:]]
            pieces = [x[begin : begin + budget] for x in group_ids]
            if not sched.fits([(s.slot, begin + len(p)) for s, p in zip(group, pieces)]):
                break  # blocks are short: the decoding step preempts or frees some
            last = begin + len(pieces[0]) >= len(ids)
            out = self.runner.forward(head.slot, pieces, [begin] * len(group), "last" if last else "none",
                                      aux_layers=self.proposer.aux_layers,
                                      return_hidden=self.proposer.needs_hidden and last)
            if out.aux or out.hidden is not None:
                for i, (s, piece) in enumerate(zip(group, pieces)):
                    self.proposer.observe(s, out.hidden[i] if out.hidden is not None else None,
                                          [a[i, : len(piece)] for a in out.aux], reset=begin == 0)
            for s, piece in zip(group, pieces):
                s.num_computed = begin + len(piece)
                budget -= len(piece)
                self.stats.prefill_tokens += len(piece)
            if not last:
                break  # a chunk of a long prompt took the budget
            tokens = self.verifier.next_tokens(group, out.logits)
            for i, (s, x, t) in enumerate(zip(group, group_ids, tokens)):
                if not s.output_ids:  # a new sequence (a recomputed one decodes on from its last token)
                    s.append_tokens([t])
                    if s.logprobs is not None:
                        s.record_logprobs(out.logits[i : i + 1], [t])
                if self.prefix_caching:
                    self.runner.register_prefix(s.slot, x, s.num_computed)
                self._join(s)
                joined.append(s)
        self.stats.prefill_s += time.perf_counter() - t0
        return joined

    def _join(self, s: Sequence) -> None:
        """``s`` (prefilled) joins the running batch in the next slot: its block table moves there (a
        prefilling sequence that sat in that slot takes ``s``'s)."""
        sched = self.scheduler
        sched.prefilling.remove(s)
        slot = len(self.running)
        if s.slot != slot:
            other = next((p for p in sched.prefilling if p.slot == slot), None)
            self.runner.swap_slots(s.slot, slot)
            if other is not None:
                other.slot = s.slot
            s.slot = slot
        self.running.append(s)

    def _draft_budget(self, s: Sequence, k: int | None = None) -> int:
        """Drafts worth verifying for ``s`` (at most ``k``, default the proposer's): none past max_tokens
        or max_model_len."""
        k = self.proposer.num_speculative_tokens if k is None else k
        if s.params.max_tokens is not None:
            k = min(k, s.params.max_tokens - len(s.output_ids) - 1)
        return max(0, min(k, self.max_model_len - len(s) - 1))

    def _reserve_blocks(self) -> list[int]:
        """Draft budgets whose tokens the KV cache can hold this step: every sequence's full budget, or
        none (speculation backs off), preempting the most recently admitted sequences while even their
        last tokens do not fit."""
        budgets = [self._draft_budget(s) for s in self.running]
        if self.scheduler.reserve([s.num_computed + 1 + k for s, k in zip(self.running, budgets)]):
            return budgets
        while not self.scheduler.reserve([s.num_computed + 1 for s in self.running]):
            self._give_back(self.scheduler.preempt())
        return [0] * len(self.running)

    def _give_back(self, s: Sequence) -> None:
        """``s`` leaves its slot (aborted or preempted): its blocks and the drafter's state for it go."""
        self.runner.release_slot(s.slot)
        self.proposer.forget(s)
        s.slot = -1

    def _decode(self) -> None:
        """One decoding step of the running batch: blocks -> drafts -> one target forward -> verification
        -> the emitted tokens appended."""
        t0 = time.perf_counter()
        budgets = self._reserve_blocks()
        seqs = self.running
        if not seqs:
            return
        drafts, matches = self._propose(seqs, budgets)
        batch = forward_inputs(seqs, drafts)
        out = self.runner.forward(0, batch.tokens, batch.starts, "all", aux_layers=self.proposer.aux_layers,
                                  tree_mask=batch.tree_mask, positions=batch.positions,
                                  return_hidden=self.proposer.needs_hidden)
        results = self.verifier.verify(seqs, drafts, batch.starts, out.logits)
        self._commit(seqs, drafts, batch, out, results, matches)
        self.stats.verified_tokens += sum(len(t) for t in batch.tokens)
        self.stats.decode_steps += 1
        self.stats.decode_s += time.perf_counter() - t0

    def _propose(self, seqs, budgets: list[int]) -> tuple[Drafts, list]:
        """The drafter's chains or trees within ``budgets``, with n-gram branches grafted in where the
        engine adds them, every random row as a tree under an opt-in lossy rule, and no drafts where a
        tree needs more KV blocks than are free. Also returns each row's n-gram matches."""
        matches = self._ngram_matches(seqs) if self.ngram_branch else [[] for _ in seqs]
        planned = self.proposer.plans_branches and self.ngram_branch
        if not any(budgets):
            return Drafts.none(len(seqs)), matches
        branches = [[self.branch_acceptance.draft(key, toks) for toks, key in m] for m in matches] if planned else None
        t_draft = time.perf_counter()
        prop = self.proposer.propose(ProposeInputs(seqs, budgets, branches))
        self.stats.draft_s += time.perf_counter() - t_draft
        chains = [list(c[:m]) for c, m in zip(prop.chains, budgets)]
        trees = prop.trees if prop.has_trees else [None] * len(seqs)
        drafts = Drafts(chains, trees, prop.draft_probs, prop.own_nodes or [None] * len(seqs))
        lossy = self.proposer.lossy_verify is not None
        if self.ngram_branch and not planned and prop.draft_probs is None and not lossy:
            grafted = [graft(t, s.output_ids[-1], c, [toks for toks, _ in m], self._branch_trees)
                       for s, c, t, m in zip(seqs, chains, trees, matches)]  # whole branches below the drafter's
            drafts = Drafts(chains, [g[0] for g in grafted], None, [g[1] for g in grafted])
        self.stats.ngram_branch_tokens += sum(len(t.tokens) - o for t, o in zip(drafts.trees, drafts.own_nodes)
                                              if o is not None)
        if lossy:  # opt-in lossy acceptance: every random row as a tree
            drafts.trees = [t if t is not None or s.params.greedy else TreeDraft([s.output_ids[-1]] + c,
                                                                                path_tree(len(c)))
                            for s, c, t in zip(seqs, chains, drafts.trees)]
        if drafts.has_trees and not self.scheduler.reserve(
                [s.num_computed + n for s, n in zip(seqs, drafts.tokens_per_row())]):
            return Drafts.none(len(seqs)), matches  # trees larger than the blocks reserved: no drafts
        return drafts, matches

    def _commit(self, seqs, drafts: Drafts, batch, out, results, matches) -> None:
        """Append each sequence's emitted tokens; tell the drafter what was accepted and the target
        features of the positions kept; update the metrics and the n-gram branch statistics."""
        emitted_total = 0
        for b, (s, (emitted, kept_idx)) in enumerate(zip(seqs, results)):
            accepted = len(emitted) - 1
            self.metrics.record(drafts.depth(b), accepted)
            own = accepted
            if drafts.own_nodes and drafts.own_nodes[b] is not None:  # the drafter's nodes: a prefix of any path
                own = sum(1 for i in kept_idx[1:] if i < drafts.own_nodes[b])
                self.stats.ngram_branch_wins += own < accepted
            self.proposer.verified(s, own)
            s.num_computed = batch.starts[b] + 1 + accepted
            if out.aux or out.hidden is not None:  # the target features of the positions now kept
                idx = torch.tensor(kept_idx, dtype=torch.long, device=out.logits.device)
                self.proposer.observe(s, out.hidden[b, kept_idx[-1]] if out.hidden is not None else None,
                                      [a[b, idx] for a in out.aux], reset=False)
            for toks, key in matches[b]:
                self.branch_acceptance.observe(key, toks, emitted)
            kept = s.append_tokens(emitted)
            if s.logprobs is not None:  # emitted[j] was chosen from the logits of position kept_idx[j]
                s.record_logprobs(out.logits[b, kept_idx[:kept]], emitted[:kept])
            emitted_total += kept
        self.stats.decode_tokens += emitted_total

    @property
    def ngram_branch(self) -> int:
        """Tokens per n-gram branch (0: no branches)."""
        return self.branch_opts.tokens

    def _ngram_matches(self, seqs) -> list[list[tuple[list[int], tuple]]]:
        """``ngram_branch``: each sequence's n-gram continuations, (tokens, ``branch_acceptance`` key:
        sampling setting, matched n, rank) each, from the sequence itself and from ``ngram_pool`` (earlier
        requests), offered as more branches of the drafter's chain or tree. The drafters miss on different
        tokens: chat answers repeat words of the prompt, of themselves and of earlier answers, which a
        trained drafter often does not predict. Verification stays lossless (deterministic drafts,
        one-hot rule), whichever wins."""
        out = []
        for s in seqs:
            k = self._draft_budget(s, self.ngram_branch)
            ids = torch.tensor(s.all_ids, dtype=torch.long)
            found = ngram_candidates(ids, k, self.branch_opts.candidates, self.ngram_pool) if k else []
            key = sampling_key(s.params)
            out.append([(toks, (key, n, r)) for r, (toks, n) in enumerate(found)])
        return out

    def get_metrics(self) -> dict:
        return self.metrics.as_dict()

    def _free_finished(self) -> None:
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if not s.finished:
                i += 1
                continue
            self.proposer.forget(s)
            if self.ngram_pool is not None:
                self.ngram_pool.add(s.all_ids)
            if self.prefix_caching:  # its committed blocks serve later requests with the same prefix
                self.runner.register_prefix(s.slot, s.all_ids, s.num_computed)
            self.runner.release_slot(s.slot)
            last = self.running.pop()
            if last is not s:
                self.runner.move_slot(last.slot, s.slot)
                last.slot = s.slot
                self.running[i] = last
            s.slot = -1

    def shutdown(self) -> None:
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()


@dataclasses.dataclass(frozen=True)
class NgramBranchOptions:
    """The engine's n-gram branches (``speculative_config`` keys): ``ngram_branch`` tokens per branch
    (0: none), ``ngram_candidates`` branches per step (distinct continuations), ``ngram_pool``: also
    match earlier requests' tokens, not only the sequence's own."""

    tokens: int = 0
    candidates: int = 1
    pool: bool = False


def split_ngram_branch(spec) -> tuple[object, NgramBranchOptions]:
    """``speculative_config`` -> (the drafter's own config, ``NgramBranchOptions``). The options belong
    to the engine, not to a drafter."""
    keys = ("ngram_branch", "ngram_candidates", "ngram_pool")
    if spec is None or not any(k in spec.options for k in keys):
        return spec, NgramBranchOptions()
    opts = dict(spec.options)
    k, cands, pool = opts.pop("ngram_branch", 0), opts.pop("ngram_candidates", 1), opts.pop("ngram_pool", False)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 32:
        raise ValueError(f"ngram_branch must be an int in 0..32 (n-gram draft tokens per step), got {k!r}")
    if isinstance(cands, bool) or not isinstance(cands, int) or not 1 <= cands <= 8:
        raise ValueError(f"ngram_candidates must be an int in 1..8 (n-gram branches per step), got {cands!r}")
    if not isinstance(pool, bool):
        raise ValueError(f"ngram_pool must be true or false, got {pool!r}")
    if not k and ("ngram_candidates" in spec.options or pool):
        raise ValueError("ngram_candidates and ngram_pool need ngram_branch (tokens per branch) > 0")
    if spec.method == "ngram" and k:
        raise ValueError("ngram_branch adds n-gram drafts to another drafter's; method 'ngram' already drafts them")
    return dataclasses.replace(spec, options=opts), NgramBranchOptions(k, cands, pool)
