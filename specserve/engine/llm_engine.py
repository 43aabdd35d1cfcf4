"""The engine loop: admit requests, prefill them in chunks, then decode the running batch one
forward per step. Running sequences occupy KV slots 0..B-1 (a finished one's slot is refilled by
moving the last sequence into it), so a step attends to views of the cache, never copies."""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.model_runner import ModelRunner, TPRunner
from specserve.engine.sequence import Sequence, Status
from specserve.models.loader import resolve_model_dir
from specserve.sample.sampler import SamplingBatch, sample
from specserve.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, model=None, cfg: EngineConfig | None = None, device: str = "cpu"):
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_dir = resolve_model_dir(model)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        if cfg.tensor_parallel_size > 1:
            if device != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs worker processes on CPU (gloo) only for now")
            self.runner = TPRunner(self.model_dir, cfg.tensor_parallel_size, cfg.dtype, cfg.max_num_seqs,
                                   cfg.num_threads)
        else:
            self.runner = ModelRunner(self.model_dir, None, cfg.dtype, device, cfg.max_num_seqs)
        self.model_config = self.runner.config
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        eos = self.tokenizer.eos_token_ids or []
        cfg_eos = self.model_config.eos_token_id
        eos += [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
        self.eos_ids = list(dict.fromkeys(eos))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0}

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not (0 <= int(t) < V)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        gen = torch.Generator().manual_seed(seed)
        seq = Sequence(next(self._ids), prompt, prompt_ids, params, gen, self.tokenizer, self.eos_ids, self.max_model_len)
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            seq._finish("abort")
            self._free_finished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit and prefill what fits, then decode the running batch once. Returns the sequences
        that changed in this step (new tokens or finished)."""
        touched = []
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting.popleft()
            seq.slot = len(self.running)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._prefill(seq)
            touched.append(seq)
        self._free_finished()
        if self.running:
            touched.extend(s for s in self.running if s not in touched)
            self._decode()
        self._free_finished()
        self.stats["steps"] += 1
        return touched

    def _prefill(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        ids = seq.prompt_ids
        chunk = self.cfg.prefill_chunk
        out = None
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            last = start + chunk >= len(ids)
            out = self.runner.forward(seq.slot, [piece], [start], "last" if last else "none")
        seq.num_computed = len(ids)
        token = sample(out.logits, SamplingBatch.build([seq.params], [seq.generator]))
        seq.append_tokens(token.tolist())
        self.stats["prefill_tokens"] += len(ids)
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _decode(self) -> None:
        t0 = time.perf_counter()
        seqs = self.running
        out = self.runner.forward(0, [[s.output_ids[-1]] for s in seqs], [s.num_computed for s in seqs], "last")
        tokens = sample(out.logits, SamplingBatch.build([s.params for s in seqs], [s.generator for s in seqs]))
        for s, t in zip(seqs, tokens.tolist()):
            s.num_computed += 1
            s.append_tokens([t])
        self.stats["decode_tokens"] += len(seqs)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _free_finished(self) -> None:
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if not s.finished:
                i += 1
                continue
            last = self.running.pop()
            if last is not s:
                self.runner.move_slot(last.slot, s.slot, last.num_computed)
                last.slot = s.slot
                self.running[i] = last
            s.slot = -1

    def shutdown(self) -> None:
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
