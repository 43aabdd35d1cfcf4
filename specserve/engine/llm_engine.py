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
from specserve.device import resolve_device
from specserve.engine.model_runner import ModelRunner, TPRunner, resolve_activations, resolve_quantization
from specserve.engine.prefix_features import PrefixFeatures
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence
from specserve.engine.spec_gate import SpeculationGate
from specserve.engine.verify import Drafts, Verifier, forward_inputs
from specserve.models.loader import gguf_source, read_config, resolve_model_dir
from specserve.spec_decode import ProposeInputs, build_proposer
from specserve.spec_decode.metrics import SpecMetrics
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
    prefix_cached_tokens: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        self.proposer = build_proposer(cfg.speculative)
        if cfg.tensor_parallel_size > 1:
            if device != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs worker processes on CPU (gloo) only for now")
            # before any worker starts: what a sharded model can run (``resolve_quantization``)
            resolve_activations(cfg.activations, resolve_quantization(
                cfg.quantization, cfg.dtype, gguf_source(self.model_dir) is not None, device, cfg.tensor_parallel_size))
            self.runner = TPRunner(self.model_dir, cfg.tensor_parallel_size, cfg.dtype, cfg.max_num_seqs,
                                   cfg.num_threads, cfg.quantization, cfg.kv_cache_memory, self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_dir, None, cfg.dtype, device, cfg.max_num_seqs,
                                      quantization=cfg.quantization, kv_cache_memory=cfg.kv_cache_memory,
                                      max_model_len=self.max_model_len, activations=cfg.activations)
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
        self.proposer.load_model(self.runner)
        self.runner.reset_kv()  # the blocks of the start-up measurements are given back
        self.metrics = SpecMetrics()
        self.scheduler = Scheduler(cfg.max_num_seqs, self.runner.kv.blocks)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running  # the same objects
        self.prefix_caching = cfg.enable_prefix_caching
        # a drafter that reads the target's features of every position gets those of the shared positions
        # from a store of earlier sequences' features (a prefix is shared only as far as they are kept)
        self.prefix_features = (PrefixFeatures(self.runner.kv.blocks.block_size)
                                if self.prefix_caching and self.proposer.aux_layers else None)
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self.verifier = Verifier(cfg.sampling_mode, self.proposer.lossy_verify, self.runner.compact)
        # speculation_gate: draft only for kinds of batch where it pays (``SpeculationGate``, ``gate_key``)
        self.gate = (SpeculationGate(keep_probing=lambda key: key == (1, True))
                     if cfg.speculation_gate and self.proposer.num_speculative_tokens else None)
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
                self._share_prefix(seq)
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
                    self._observe(s, out.hidden[i] if out.hidden is not None else None,
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

    def _room(self, s: Sequence) -> int:
        """Draft tokens ``s`` has room for: none past max_tokens or max_model_len."""
        k = self.max_model_len - len(s) - 1
        if s.params.max_tokens is not None:
            k = min(k, s.params.max_tokens - len(s.output_ids) - 1)
        return max(0, k)

    def _reserve_blocks(self, drafting: bool = True) -> list[int]:
        """Draft budgets whose tokens the KV cache can hold this step: every sequence's full budget (none
        when not ``drafting``), or none (speculation backs off), preempting the most recently admitted
        sequences while even their last tokens do not fit."""
        k = self.proposer.num_speculative_tokens if drafting else 0
        budgets = [min(k, self._room(s)) for s in self.running]
        if self.scheduler.reserve([s.num_computed + 1 + k for s, k in zip(self.running, budgets)]):
            return budgets
        while not self.scheduler.reserve([s.num_computed + 1 for s in self.running]):
            self._give_back(self.scheduler.preempt())
        return [0] * len(self.running)

    def _give_back(self, s: Sequence) -> None:
        """``s`` leaves its slot (aborted or preempted): its blocks and the drafter's state for it go."""
        self.runner.release_slot(s.slot)
        self._forget(s)
        s.slot = -1

    def _forget(self, s: Sequence) -> None:
        self.proposer.forget(s)
        if self.prefix_features is not None:
            self.prefix_features.forget(s)

    def _share_prefix(self, seq: Sequence) -> None:
        """Give the admitted ``seq`` the cached blocks of its prompt's prefix (prefix caching), for a drafter
        that reads the target's features only as far as the store holds them, which it then observes."""
        ids = self.scheduler.prefill_ids(seq)
        features = None
        if self.prefix_features is not None:
            n, features = self.prefix_features.lookup(ids)
            ids = ids[: n + 1]  # never shares the block of the last id
        seq.num_computed = self.runner.share_prefix(seq.slot, ids)
        self.stats.prefix_cached_tokens += seq.num_computed
        if features and seq.num_computed:
            self._observe(seq, None, [f[: seq.num_computed] for f in features], reset=True)

    def _observe(self, seq: Sequence, hidden, aux: list, reset: bool) -> None:
        """The target's features of ``seq``'s newly kept positions (whose tokens ``seq`` already holds) to
        the drafter, and to the prefix caching's store of features where there is one."""
        self.proposer.observe(seq, hidden, aux, reset)
        if self.prefix_features is not None and aux:
            self.prefix_features.observe(seq, aux, reset)

    def _decode(self) -> None:
        """One decoding step of the running batch: blocks -> drafts -> one target forward -> verification
        -> the emitted tokens appended."""
        t0 = time.perf_counter()
        drafting = self.gate is None or self.gate.draft(self.gate_key(self.running))
        budgets = self._reserve_blocks(drafting)
        seqs = self.running
        if not seqs:
            return
        drafts = self._propose(seqs, budgets)
        t_verify = time.perf_counter()
        batch = forward_inputs(seqs, drafts)
        out = self.runner.forward(0, batch.tokens, batch.starts, "all", aux_layers=self.proposer.aux_layers,
                                  tree_mask=batch.tree_mask, positions=batch.positions,
                                  return_hidden=self.proposer.needs_hidden)
        results = self.verifier.verify(seqs, drafts, batch.starts, out.logits)
        emitted = self._commit(seqs, drafts, batch, out, results)
        self.stats.verified_tokens += sum(len(t) for t in batch.tokens)
        self.stats.decode_steps += 1
        t1 = time.perf_counter()
        seconds = t1 - t0
        self.stats.decode_s += seconds
        if len(seqs) == 1:  # what verifying that many tokens costs in the engine (the drafter's cost model)
            self.proposer.step_cost(len(batch.tokens[0]), t1 - t_verify)
        if self.gate is not None and (any(budgets) or not drafting):  # a step that could draft, or chose not to
            self.gate.record(self.gate_key(seqs), drafting, emitted, seconds)

    @staticmethod
    def gate_key(seqs) -> tuple[int, bool]:
        """The speculation gate's kind of batch: its size, and whether every request in it is greedy
        (sampled requests accept fewer drafts: their rates are kept apart)."""
        return len(seqs), all(s.params.greedy for s in seqs)

    def _propose(self, seqs, budgets: list[int]) -> Drafts:
        """The drafter's chains or trees within ``budgets``; no drafts where a tree needs more KV blocks
        than are free."""
        if not any(budgets):
            return Drafts.none(len(seqs))
        t_draft = time.perf_counter()
        prop = self.proposer.propose(ProposeInputs(seqs, budgets, [self._room(s) for s in seqs]))
        self.stats.draft_s += time.perf_counter() - t_draft
        chains = [list(c[:m]) for c, m in zip(prop.chains, budgets)]
        drafts = Drafts(chains, prop.trees if prop.has_trees else [None] * len(seqs), prop.draft_probs)
        if drafts.has_trees and not self.scheduler.reserve(
                [s.num_computed + n for s, n in zip(seqs, drafts.tokens_per_row())]):
            return Drafts.none(len(seqs))  # trees larger than the blocks reserved: no drafts
        return drafts

    def _commit(self, seqs, drafts: Drafts, batch, out, results) -> int:
        """Append each sequence's emitted tokens; tell the drafter what was accepted and the target
        features of the positions kept; update the metrics. Returns the tokens emitted."""
        emitted_total = 0
        single = all(len(t) == 1 for t in batch.tokens)  # no drafts: every row keeps its one position
        for b, (s, (emitted, kept_idx)) in enumerate(zip(seqs, results)):
            accepted = len(emitted) - 1
            self.metrics.record(drafts.depth(b), accepted)
            self.proposer.verified(s, emitted, kept_idx)
            s.num_computed = batch.starts[b] + 1 + accepted
            kept = s.append_tokens(emitted)
            if out.aux or out.hidden is not None:  # the target features of the positions now kept
                if single:  # row b's [1, d] (views of the step's small outputs: no index tensor, no copy)
                    feats = [a[b] for a in out.aux]
                else:
                    idx = torch.tensor(kept_idx, dtype=torch.long, device=out.logits.device)
                    feats = [a[b, idx] for a in out.aux]
                self._observe(s, out.hidden[b, kept_idx[-1]] if out.hidden is not None else None, feats,
                              reset=False)
            if s.logprobs is not None:  # emitted[j] was chosen from the logits of position kept_idx[j]
                s.record_logprobs(out.logits[b, kept_idx[:kept]], emitted[:kept])
            emitted_total += kept
        self.stats.decode_tokens += emitted_total
        return emitted_total

    def get_metrics(self) -> dict:
        return self.metrics.as_dict()

    def _free_finished(self) -> None:
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if not s.finished:
                i += 1
                continue
            self._forget(s)
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

