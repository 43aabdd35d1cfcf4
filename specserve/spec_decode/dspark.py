"""DSpark / DFlash drafting: a block drafter conditioned on target hidden states of several layers
(KV injection), with DSpark's Markov head correcting each draft by the one chosen before it.

speculative_config keys: ``model`` (a DeepSpec, speculators or z-lab checkpoint; default: the drafter
shipped for the default model in ``specserve/checkpoints/{dspark,dflash}-smollm2-135m``), ``num_speculative_tokens`` (<= the block's drafts),
``draft_sample_method``: ``"greedy"`` (argmax of the Markov-corrected logits, verified with the
one-hot rule) or ``"probabilistic"`` (each draft sampled from the corrected distribution at the
request's temperature, its exact q kept for rejection sampling), and ``dspark_verify``: ``"full"``
(verify every draft) or ``"threshold"`` (verify up to the first draft whose confidence is below
``confidence_threshold``; the cut depends on confidences only, never on whether drafts will be
accepted, so it is lossless). Both methods are lossless at any temperature.

Status: one sequence's block per forward (a batch drafts sequence by sequence), no tensor parallelism
for the drafter yet, and no cost-model ("auto") scheduling yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.spec_decode.proposer import Proposal, Proposer, ProposeInputs


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


class DSparkProposer(Proposer):
    name = "dspark"

    def __init__(self, model: str | None = None, num_speculative_tokens: int | None = None,
                 draft_sample_method: str = "greedy", dspark_verify: str = "full",
                 confidence_threshold: float = 0.5):
        if model is None:
            model = SHIPPED_DIR / f"{self.name}-smollm2-135m"
            if not model.exists():
                raise ValueError(f"method {self.name!r} needs a drafter checkpoint: speculative_config['model'] "
                                 "(none is shipped for it)")
        if draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method must be 'greedy' or 'probabilistic', got {draft_sample_method!r}")
        if dspark_verify not in ("full", "threshold"):
            raise ValueError(f"dspark_verify must be 'full' or 'threshold' (auto is not available yet), "
                             f"got {dspark_verify!r}")
        self.model_path = Path(model)
        self.requested_k = num_speculative_tokens
        self.sample_method = draft_sample_method
        self.verify_mode = dspark_verify
        self.threshold = confidence_threshold
        self.caches: dict[int, object] = {}

    def load_model(self, target) -> None:
        from specserve.spec_decode.dspark_formats import load_dspark_checkpoint
        from specserve.spec_decode.dspark_model import DFlashDrafter

        if target.tp.size > 1:
            raise NotImplementedError("DSpark drafting under tensor parallelism is not available yet")
        if not self.model_path.exists():
            raise FileNotFoundError(f"DSpark checkpoint not found: {self.model_path}")
        cfg, sd = load_dspark_checkpoint(self.model_path, target.config)
        self.cfg = cfg
        self.drafter = DFlashDrafter(cfg, dtype=target.dtype)
        self.drafter.load_state(sd)
        self.drafter.eval().requires_grad_(False)
        self.aux_layers = tuple(cfg.target_layer_ids)
        k = self.requested_k or cfg.num_drafts
        if k > cfg.num_drafts:
            raise ValueError(f"num_speculative_tokens ({k}) exceeds the drafter's {cfg.num_drafts} drafts per block")
        self.num_speculative_tokens = k
        conf = json.loads((self.model_path / "config.json").read_text()) if self.model_path.is_dir() else {}
        self.conf_temps = conf.get("confidence_temperatures")  # STS calibration, one per position
        self.embed = target.model.model.embed_tokens
        self.logits_fn = target.model.compute_logits
        self.vocab_size = target.config.vocab_size

    def dummy_run(self, batch_size: int = 1) -> None:
        cache = self.drafter.new_cache()
        d = self.cfg.hidden_size * len(self.aux_layers)
        cache.extend(torch.zeros(2, d), [0, 1])
        self.drafter.propose(0, 2, cache, self.embed, self.logits_fn, num_drafts=1)

    def observe(self, seq, last_hidden, aux, reset) -> None:
        cache = self.caches.get(seq.seq_id)
        if cache is None:
            cache = self.caches[seq.seq_id] = self.drafter.new_cache()
        if reset:
            cache.reset()
        n = aux[0].shape[0]
        start = len(cache)
        cache.extend(torch.cat(aux, dim=-1), list(range(start, start + n)))

    def forget(self, seq) -> None:
        self.caches.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> Proposal:
        chains, probs = [], []
        probabilistic = self.sample_method == "probabilistic"
        for s, m in zip(inputs.seqs, inputs.max_drafts):
            k = min(m, self.num_speculative_tokens)
            if k <= 0:
                chains.append([])
                probs.append(None)
                continue
            temp = s.params.temperature if probabilistic and not s.params.greedy else 0.0
            blk = self.drafter.propose(s.output_ids[-1], s.num_computed, self.caches[s.seq_id], self.embed,
                                       self.logits_fn, temperature=temp, generator=s.generator, num_drafts=k)
            toks = [int(t) for t in blk.tokens][:k]
            if self.verify_mode == "threshold" and blk.confidences is not None:
                conf = self._calibrated(blk.confidences[: len(toks)])
                cut = next((i for i, c in enumerate(conf) if c < self.threshold), len(toks))
                toks = toks[:cut]
            chains.append(toks)
            probs.append(blk.probs[: len(toks)] if blk.probs is not None else None)
        draft_probs = None
        if probabilistic and any(p is not None for p in probs):
            K = max(len(c) for c in chains)
            draft_probs = torch.zeros(len(chains), K, self.vocab_size)
            for b, p in enumerate(probs):
                if p is not None and len(p):
                    draft_probs[b, : p.shape[0]] = p.float()
        return Proposal(chains, draft_probs)


    def _calibrated(self, c: torch.Tensor) -> list[float]:
        """Confidences after the checkpoint's sequential temperature scaling (if it has one)."""
        if not self.conf_temps:
            return c.float().tolist()
        t = torch.tensor(self.conf_temps[: len(c)] + [1.0] * max(0, len(c) - len(self.conf_temps)))
        return torch.sigmoid(torch.logit(c.float().clamp(1e-6, 1 - 1e-6)) / t).tolist()


class DFlashProposer(DSparkProposer):
    """The same drafter without the Markov head (a ``markov_rank: 0`` checkpoint)."""

    name = "dflash"
