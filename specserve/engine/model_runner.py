"""ModelRunner: owns the model and the KV cache of one rank and runs forwards over a batch in which
every sequence appends its own number of new tokens (1 for decoding, k+1 for verification, a whole
chunk for prefill) at its own position.

Under tensor parallelism the driver (rank 0) holds a ``TPRunner`` that forwards each call to worker
processes (one ``ModelRunner`` each) before running it itself; the collectives inside the forward keep
the ranks in step. A drafter that must run on every rank (one that uses the target's sharded embedding
or lm_head, or shards a head of its own) is attached as a rank-local *helper* (``attach``) and driven
through ``call_helper``, which runs on all ranks and returns the driver's result."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import ACTIVATIONS, QUANTIZATIONS, ModelConfig
from specserve.device import resolve_device, resolve_dtype, synchronize
from specserve.distributed.parallel_state import TPGroup, free_port, init_tp_group
from specserve.engine.kv_cache import BLOCK_SIZE, KVCache
from specserve.layers import cpu_ops
from specserve.layers.attention import ForwardContext
from specserve.layers.embed_head import VocabParallelEmbedding
from specserve.layers.linear import PackedGEMM, mkldnn_packing_available
from specserve.layers.packing import make_batch_invariant, pack_linears
from specserve.layers.quant import PendingQuant, QuantTensor, int8_activations_available, quantize
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import gguf_source, iter_weights, load_weights, read_config


def resolve_quantization(quantization: str | None, dtype, is_gguf: bool, device: str = "cpu",
                         tensor_parallel_size: int = 1) -> str | None:
    """``auto``: a GGUF's own quantization (``gguf``) on CPU unless float32 is asked for or the model is
    sharded, else None (dense). ``gguf`` needs a GGUF; any quantization runs on CPU only (the weight-only
    kernels of ``layers.quant``). Under tensor parallelism, bfloat16 (and so quantized weights) gives wrong
    tokens in the batch-invariant mode (a known bug, found while adding quantization, not yet fixed):
    sharded models run dense float32, and asking for bfloat16 or a quantization with them is an error."""
    q = None if quantization in (None, "none") else quantization
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization must be auto, none, gguf, int8 or int4, got {quantization!r}")
    if tensor_parallel_size > 1 and (q not in (None, "auto") or dtype in ("bfloat16", "bf16", torch.bfloat16)):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} runs dense float32 weights only for now "
                         f"(bfloat16 and quantized weights give wrong tokens when sharded: a known bug); "
                         f"got dtype={dtype!r}, quantization={quantization!r}")
    if q == "auto":
        wants_fp32 = dtype in ("float32", "fp32", torch.float32)
        return "gguf" if is_gguf and device == "cpu" and not wants_fp32 and tensor_parallel_size == 1 else None
    if q == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a .gguf model (an HF directory takes int8 or int4)")
    if q and device != "cpu":
        raise ValueError(f"quantization={q!r} runs on the CPU only; on {device} use quantization=None")
    return q


def resolve_activations(activations: str, quantization: str | None) -> bool:
    """Whether a quantized model's group kernels take x in 8-bit groups of 32 (``layers.quant``, as
    llama.cpp's kernels do): "int8", which needs weights in groups (quantization "gguf" or "int4") and the
    C++ kernel (AVX-512 VNNI or AVX2), or "bfloat16" (every product of a code and an activation exact)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations == "bfloat16":
        return False
    if quantization not in ("gguf", "int4"):
        raise ValueError(f"activations='int8' needs weights in groups of 32 (quantization 'gguf' or 'int4'), "
                         f"got quantization={quantization!r}")
    if not int8_activations_available():
        raise ValueError("activations='int8' needs specserve's C++ kernel for it (AVX-512 VNNI or AVX2 + FMA), "
                         "which this machine does not have; use activations='bfloat16'")
    return True


def _weight_modules(model: torch.nn.Module):
    """(module, its weight parameter) for every linear, LM head and embedding of ``model``."""
    for m in model.modules():
        if isinstance(m, (PackedGEMM, VocabParallelEmbedding)):
            yield m, m.weight


def expect_quantized(model: torch.nn.Module) -> None:
    """Let every linear, LM head and embedding weight of ``model`` take quantized checkpoint tensors
    (``QuantTensor``) through its own weight loader (``PendingQuant``); ``finish_quantized`` after."""
    for m, p in _weight_modules(model):
        if getattr(p, "pending", None) is None:
            pending = p.pending = PendingQuant(tuple(p.shape), type(m).__name__)
            loader = p.weight_loader

            def load(param, loaded, shard_id=None, loader=loader, pending=pending):
                if not isinstance(loaded, QuantTensor):  # a float matrix: 8 bits in groups of 32
                    loaded = quantize(loaded, 8, 32, "float->int8-g32")
                loader(pending, loaded, shard_id)

            p.weight_loader = load
            p.data = torch.empty(0, dtype=p.dtype)


def finish_quantized(model: torch.nn.Module) -> None:
    """Assemble each weight's loaded parts (``expect_quantized``) into the modules' ``quant``."""
    done = {}
    for m, p in _weight_modules(model):
        if id(p) not in done:
            done[id(p)] = p.pending.finish()
        m.quant = done[id(p)]


def quantize_weights(model: torch.nn.Module, scheme: str) -> None:
    """Quantize the loaded float weights of ``model`` (``quant`` on each module, the float weight
    freed): ``int8``: every weight int8 per output channel; ``int4``: the linears int4 in groups of 32,
    the embedding and LM head int8 per output channel."""
    done = {}
    for m, p in _weight_modules(model):
        if id(p) not in done:
            table = isinstance(m, VocabParallelEmbedding)
            done[id(p)] = quantize(p.data, 4, 32) if scheme == "int4" and not table else quantize(p.data, 8)
        m.quant = done[id(p)]
    for _, p in _weight_modules(model):
        p.data = torch.empty(0, dtype=p.dtype)


KV_MEMORY_SHARE = 0.25  # kv_cache_memory=None: at most this share of the machine's memory


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def kv_cache_blocks(kv_cache_memory: float | None, max_num_seqs: int, max_model_len: int, block_bytes: int) -> int:
    """Blocks of the KV pool. ``kv_cache_memory`` (GiB): that budget; None: room for ``max_num_seqs``
    sequences of ``max_model_len`` positions, at most ``KV_MEMORY_SHARE`` of the machine's memory (the
    pool is reserved, not resident: pages are used as blocks are). The budget must hold one sequence of
    ``max_model_len`` positions (a clear error says what to change)."""
    per_seq = -(-max_model_len // BLOCK_SIZE)
    if kv_cache_memory is None:
        budget_blocks = int(KV_MEMORY_SHARE * _total_memory()) // block_bytes
        return min(max_num_seqs * per_seq, max(budget_blocks, per_seq)) + 1  # + the scratch block
    blocks = int(kv_cache_memory * (1 << 30)) // block_bytes  # the scratch block included
    if blocks < per_seq + 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} GiB holds {max(0, blocks - 1) * BLOCK_SIZE} "
                         f"positions, fewer than max_model_len ({max_model_len}) needs "
                         f"({(per_seq + 1) * block_bytes / (1 << 30):.4f} GiB): give more memory or a "
                         "smaller max_model_len")
    return blocks


LONG_STEP = 32  # token counts above this are compute-bound and steady: one timed run each


def sizes_to_time(sizes: list[int]) -> list[int]:
    """The token counts of ``sizes`` that ``measure_step_costs`` times: all up to ``LONG_STEP`` and, of
    those above it (where a step's cost grows linearly with its tokens, so that ``interp_cost`` reads
    the others off a line), the largest and the middle one. They are the start-up's longest forwards."""
    short = sorted(n for n in set(sizes) if n <= LONG_STEP)
    long = sorted(n for n in set(sizes) if n > LONG_STEP)
    return short + sorted({long[len(long) // 2], long[-1]} if long else set())


def measure_step_costs(forward, device, sizes: list[int], reps: int = 3) -> dict[int, float]:
    """Seconds of one target ``forward`` that appends ``n`` tokens to a 128-token context, for each n of
    ``sizes_to_time(sizes)``, measured on the running device in slot 0 before any request runs. Every
    size runs once untimed first (a new shape's first call creates its kernels), then the sizes are
    timed in turn, ``reps`` rounds (sizes above ``LONG_STEP`` in the first round only), so that a slow
    spell of a shared machine touches all of them alike rather than a few (whose costs the monotonic
    pass below would then carry up to every larger size); each size keeps its fastest run, as noise only
    ever adds time."""
    sizes = sizes_to_time(sizes)
    ctx = 128
    forward(0, [[0] * ctx], [0], "none")
    for n in sizes:
        forward(0, [[0] * n], [ctx], "all")
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(reps):
        for n in sizes:
            if r and n > LONG_STEP:
                continue
            synchronize(device)
            t0 = time.perf_counter()
            forward(0, [[0] * n], [ctx], "all")
            synchronize(device)
            times[n].append(time.perf_counter() - t0)
    out = {n: min(ts) for n, ts in times.items()}
    # a cost curve must not decrease with n (noise): make it monotonic
    run = 0.0
    for n in sorted(out):
        run = max(run, out[n])
        out[n] = run
    return out


# step costs measured in this process, by what decides them (``DraftTargetView.step_costs``)
_MEASURED_COSTS: dict[tuple, dict[int, float]] = {}


class DraftTargetView:
    """What a drafter sees of the target (``spec_decode.target.DraftTarget``), for ``ModelRunner`` and
    ``TPRunner`` alike: its embedding, LM head and logits, the full LM head weight, and step costs."""

    @property
    def embed_tokens(self):
        return self.model.model.embed_tokens

    @property
    def lm_head(self):
        return self.model.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def full_lm_head_weight(self) -> torch.Tensor:
        """The full (unsharded) LM head weight, read from the checkpoint (float)."""
        return self._checkpoint_tensor("model.embed_tokens.weight" if self.config.tie_word_embeddings
                                       else "lm_head.weight")

    def full_embedding_weight(self) -> torch.Tensor:
        """The full (unsharded) token embedding, read from the checkpoint (float)."""
        return self._checkpoint_tensor("model.embed_tokens.weight")

    def _checkpoint_tensor(self, name: str) -> torch.Tensor:
        for n, t in iter_weights(self.model_dir):
            if n == name:
                return t
        raise ValueError(f"{name} not found in the target checkpoint")

    def cost_key(self) -> tuple:
        """What decides the timings taken on this target: the model, weight format, device,
        tensor-parallel size and thread count (the key of the process's tables of measured costs)."""
        return (str(self.model_dir), repr(self.config), str(self.dtype), self.quantization, self.int8_activations,
                self.packed, str(self.device), self.tp.size, torch.get_num_threads())

    def step_costs(self, sizes: list[int], reps: int = 3) -> dict[int, float]:
        """``measure_step_costs`` of this target, once per process: a later engine with the same
        ``cost_key`` reads the first one's table (each engine's own steps still correct it:
        ``ModelDrafter.step_cost``)."""
        key = (*self.cost_key(), tuple(sizes), reps)
        if key not in _MEASURED_COSTS:
            _MEASURED_COSTS[key] = measure_step_costs(self.forward, self.device, sizes, reps)
        return dict(_MEASURED_COSTS[key])


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # [B, V] ("last") or [B, Q, V] ("all"), float32; None on non-driver ranks
    hidden: torch.Tensor | None = None  # final normed hidden of the same positions
    aux: list | None = None  # outputs of the requested layers, all new positions [B, Q, d]


class ModelRunner(DraftTargetView):
    def __init__(self, model_dir, tp: TPGroup | None = None, dtype="auto", device="cpu", max_num_seqs=16,
                 pack_weights: bool = True, quantization: str | None = "auto", kv_cache_memory: float | None = None,
                 max_model_len: int | None = None, activations: str = "bfloat16"):
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self.tp = tp or TPGroup()
        self.device = device = resolve_device(device)
        self.quantization = resolve_quantization(quantization, dtype, gguf_source(model_dir) is not None, device,
                                                 self.tp.size)
        self.dtype = resolve_dtype("bfloat16" if self.quantization and dtype == "auto" else dtype, device)
        self.int8_activations = resolve_activations(activations, self.quantization)
        self.config: ModelConfig = read_config(model_dir)
        with torch.device("cpu"):
            model = LlamaForCausalLM(self.config, self.tp, self.dtype)
        if self.quantization == "gguf":  # the file's own quantized blocks, never a float copy
            expect_quantized(model)
            load_weights(model, iter_weights(model_dir, keep_quantized=True))
            finish_quantized(model)
        else:
            load_weights(model, iter_weights(model_dir))
            if self.quantization:
                quantize_weights(model, self.quantization)
        self.model = model.to(device).eval()
        self.packed = device == "cpu" and pack_weights and mkldnn_packing_available(self.dtype)
        if self.packed or self.quantization:
            pack_linears(self.model, self.int8_activations)
        # bfloat16 on CPU and quantized weights: verification reproduces one-token decoding bit for bit
        # (float32 needs no help: its row differences, ~5e-5 in the logits, do not move greedy tokens
        # in practice)
        self.batch_invariant = (self.packed and self.dtype != torch.float32) or bool(self.quantization)
        if device == "cpu" and self.dtype == torch.bfloat16:
            cpu_ops.get()  # built (once) or loaded now, not inside the first request
        if self.batch_invariant:
            make_batch_invariant(self.model)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        cfg = self.config
        hkv = self.model.model.layers[0].self_attn.hkv
        num_blocks = kv_cache_blocks(kv_cache_memory, max_num_seqs, max_model_len or cfg.max_position_embeddings,
                                     KVCache.bytes_per_block(cfg.num_hidden_layers, hkv, cfg.head_dim, self.dtype))
        self.kv = KVCache(cfg.num_hidden_layers, max_num_seqs, hkv, cfg.head_dim, self.dtype, device, num_blocks)
        self.helpers: dict[str, object] = {}

    # ---- KV blocks (the same calls on every rank: the same tables) --------------------------------
    def reset_kv(self) -> None:
        """Give back every slot's blocks (the cache's prefix blocks stay cached)."""
        self.kv.blocks.release_all()

    def release_slot(self, slot: int) -> None:
        """Give back the blocks of the sequence in ``slot`` (finished, aborted or preempted)."""
        self.kv.release(slot)

    def swap_slots(self, a: int, b: int) -> None:
        """The sequences in slots ``a`` and ``b`` trade places (their block tables; no copy)."""
        self.kv.blocks.swap(a, b)

    def share_prefix(self, slot: int, tokens: list[int]) -> int:
        """Cached blocks holding a prefix of ``tokens`` for the empty ``slot``: positions shared."""
        return self.kv.blocks.share_prefix(slot, tokens)

    def register_prefix(self, slot: int, tokens: list[int], length: int) -> None:
        """Offer the full blocks of ``slot``'s first ``length`` positions (holding ``tokens``) to later
        sequences (prefix caching)."""
        self.kv.blocks.register(slot, tokens, length)

    def replica(self, max_num_seqs: int | None = None) -> "ModelRunner":
        """A second runner of the same checkpoint, dtype, weight format and device, with a KV cache of its
        own (the target as its own drafter, ``spec_decode.self_draft``). One process only."""
        if self.tp.size > 1:
            raise ValueError("a replica of a sharded target is not supported: run it with tensor_parallel_size 1")
        return ModelRunner(self.model_dir, None, self.dtype, self.device, max_num_seqs or self.max_num_seqs,
                           pack_weights=self.packed, quantization=self.quantization,
                           max_model_len=self.max_model_len)

    # ---- rank-local helpers (drafters that run on every rank) ------------------------------------
    def attach(self, name: str, factory, *args, **kwargs) -> None:
        """Build ``factory(self, *args, **kwargs)`` next to this rank's model, as helper ``name``."""
        self.helpers[name] = factory(self, *args, **kwargs)

    def call_helper(self, name: str, method: str, *args, **kwargs):
        return getattr(self.helpers[name], method)(*args, **kwargs)

    def helper(self, name: str):
        """The driver's own instance of helper ``name``."""
        return self.helpers[name]

    def helper_report(self, name: str, method: str, *args, **kwargs) -> list:
        """``method`` of helper ``name`` run on every rank: the results of all ranks, rank order."""
        return [self.call_helper(name, method, *args, **kwargs)]

    # ---- the one forward ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, slot_start: int, tokens: list[list[int]], starts: list[int], logits_mode: str = "last",
                aux_layers: tuple = (), tree_mask: list | None = None, positions: list[list[int]] | None = None,
                return_hidden: bool = False) -> StepOutput:
        """Append ``tokens[b]`` to the sequence in slot ``slot_start + b`` whose cache holds ``starts[b]``
        entries, and return logits ("last": each row's last new token; "all": every new token;
        "none"). ``tree_mask[b]`` (bool [n_b, n_b]) restricts which new tokens see each other, with
        ``positions[b]`` their RoPE positions; without it the new tokens are causal."""
        B = len(tokens)
        lens = [len(t) for t in tokens]
        Q = max(lens)
        kv_len = max(s + n for s, n in zip(starts, lens))
        self.kv.prepare(slot_start, starts, lens)
        if B == 1:
            tree = tree_mask[0] if tree_mask is not None else None
            ids, pos, ctx = self._one_sequence(slot_start, tokens[0], starts[0], positions, kv_len, tree)
        else:
            ids, pos, ctx = self._batch(slot_start, tokens, starts, lens, Q, kv_len, tree_mask, positions)
        hidden, aux = self.model(ids, pos, ctx, aux_layers)
        if logits_mode == "none":
            return StepOutput(None, None, aux)
        if logits_mode == "last":
            if all(n == Q for n in lens):
                hidden = hidden[:, -1]
            else:
                dev = self.device
                hidden = hidden[torch.arange(B, device=dev), torch.tensor([n - 1 for n in lens], device=dev)]
        logits = self.model.compute_logits(hidden)
        if not self.tp.is_driver:
            return StepOutput(None)
        return StepOutput(logits.float(), hidden if return_hidden else None, aux)

    def _one_sequence(self, slot: int, tokens: list[int], start: int, positions, kv_len: int, tree=None):
        """``forward``'s inputs for one sequence (decoding, chain or tree verification, prefill): the
        cache writes are a slice, the RoPE positions (unless given) that slice's range, and the mask
        none (one query, or a prefill from position 0: SDPA's causal mask), one comparison (causal
        tokens after a context) or, for a draft tree (``tree``: bool [Q, Q]), the context and the tree."""
        dev = self.device
        Q = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        mask, causal = None, False
        if tree is not None:
            mask = torch.ones(Q, kv_len, dtype=torch.bool, device=dev)
            mask[:, start:] = torch.as_tensor(tree, dtype=torch.bool, device=dev)
            mask = mask.view(1, 1, Q, kv_len)
        elif Q > 1 and start == 0:
            causal = True
        elif Q > 1:  # query i sees keys [0, start + i]
            key = torch.arange(kv_len, device=dev)
            mask = (key <= torch.arange(start, start + Q, device=dev).unsqueeze(-1)).view(1, 1, Q, kv_len)
        pos = None if positions is None else torch.tensor(positions, dtype=torch.long, device=dev)
        widx = torch.arange(start, start + Q, device=dev).view(1, Q)
        ctx = self._context(slot, 1, widx, kv_len, mask, causal, (start, start + Q) if positions is None else None)
        return ids, pos, ctx

    def _context(self, slot_start, B, widx, kv_len, mask, causal, positions_range=None) -> ForwardContext:
        return ForwardContext(self.kv, self.kv.tables(slot_start, B, kv_len), widx, kv_len, mask, causal,
                              positions_range)

    def _batch(self, slot_start, tokens, starts, lens, Q, kv_len, tree_mask, positions):
        """``forward``'s inputs in general: sequences padded to Q new tokens (padding writes to the
        scratch entry and sees one key), tree masks, given RoPE positions."""
        dev = self.device
        B = len(tokens)
        ids = torch.zeros(B, Q, dtype=torch.long)
        pos = torch.zeros(B, Q, dtype=torch.long)
        widx = torch.full((B, Q), -1, dtype=torch.long)  # padding: the scratch block
        for b, (t, s, n) in enumerate(zip(tokens, starts, lens)):
            ids[b, :n] = torch.tensor(t, dtype=torch.long)
            widx[b, :n] = torch.arange(s, s + n)
            pos[b, :n] = torch.tensor(positions[b], dtype=torch.long) if positions else widx[b, :n]
        key = torch.arange(kv_len)
        mask = key.view(1, 1, kv_len) <= widx.unsqueeze(-1)  # [B, Q, L]
        for b, n in enumerate(lens):
            mask[b, n:] = False
            mask[b, n:, 0] = True  # padding rows see one key (never NaN)
            if tree_mask is not None and tree_mask[b] is not None:
                s = starts[b]
                tm = torch.as_tensor(tree_mask[b], dtype=torch.bool)
                mask[b, :n, s : s + n] = tm
        mask = mask.unsqueeze(1).to(dev)
        ctx = self._context(slot_start, B, widx.to(dev), kv_len, mask, False)
        return ids.to(dev), pos.to(dev), ctx

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` decodes in slot ``dst`` from now on (its blocks move)."""
        self.kv.move(src, dst)

    @torch.inference_mode()
    def compact(self, slot: int, src_idx: list[int], dst_start: int) -> None:
        self.kv.gather_into(slot, src_idx, dst_start)

    def collective_counts(self) -> dict:
        return dict(self.tp.counts)

    def shutdown(self) -> None:
        pass


# ---- tensor parallelism over processes ----------------------------------------------------------

_REPLYING = ("collective_counts", "helper_report")  # calls whose worker results go back to the driver
START_TIMEOUT_S = 600  # a worker's start: spawn, import, model load
MAIN_GUARD_HINT = ("tensor-parallel workers are spawned processes that import your main script: a script that "
                   "builds LLM(tensor_parallel_size>1) at module level must do so under "
                   "`if __name__ == \"__main__\":`")


def _worker_main(rank, size, init_method, model_dir, dtype, max_num_seqs, threads, conn, quantization="auto",
                 kv_opts=None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it finishes the step, then stops us
    conn.send(("started", os.getpid()))
    torch.set_num_threads(threads)
    try:
        tp = init_tp_group(rank, size, init_method)
        runner = ModelRunner(model_dir, tp, dtype, "cpu", max_num_seqs, quantization=quantization, **(kv_opts or {}))
        conn.send(("ready", None))
    except BaseException as e:  # report, do not hang the driver
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the driver is gone: so are we
            os._exit(0)
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            out = getattr(runner, name)(*args, **kwargs)
            if name in _REPLYING:
                conn.send(out[0] if name == "helper_report" else out)
        except BaseException as e:  # the ranks are out of step: report and leave (the driver's call fails too)
            with contextlib.suppress(Exception):
                conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            os._exit(1)
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def sigint_deferred():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block has finished, then raise
    it: a step the driver has started on the workers is finished on every rank, so an interrupted
    ``generate`` leaves the group in step. Only the main thread receives signals; elsewhere a no-op, as
    where the process ignores Ctrl-C (a command a shell without job control started in the background
    inherits SIGINT ignored): nothing is held, so nothing is raised."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed or died: the group cannot go on (create a new ``LLM``)."""


class TPRunner(DraftTargetView):
    """Driver side of a ``tensor_parallel_size`` > 1 run: rank 0 lives here, ranks 1.. in processes.
    Every call to the workers runs with Ctrl-C deferred (``sigint_deferred``); a worker that dies is
    reported with its exit code and last error, and the runner refuses further calls."""

    def __init__(self, model_dir, size: int, dtype="auto", max_num_seqs=16, num_threads=None,
                 quantization: str | None = "auto", kv_cache_memory: float | None = None,
                 max_model_len: int | None = None):
        import torch.multiprocessing as mp

        kv_opts = {"kv_cache_memory": kv_cache_memory, "max_model_len": max_model_len}
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned worker importing the main script
            raise RuntimeError(MAIN_GUARD_HINT)
        ctx = mp.get_context("spawn")
        threads = num_threads or max(1, (os.cpu_count() or 2) // size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.conns, self.procs = [], []
        self.failed: str | None = None
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, daemon=True,
                                args=(rank, size, init_method, str(model_dir), dtype, max_num_seqs, threads, child,
                                      quantization, kv_opts))
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
            self._await("started")
            torch.set_num_threads(threads)
            self.local = ModelRunner(model_dir, init_tp_group(0, size, init_method), dtype, "cpu", max_num_seqs,
                                     quantization=quantization, **kv_opts)
            self._await("ready")
        except BaseException:
            self.shutdown()
            raise
        self.config, self.dtype, self.tp = self.local.config, self.local.dtype, self.local.tp
        self.device = self.local.device  # "cpu": the ranks are gloo processes
        self.max_num_seqs = max_num_seqs
        self.model_dir = self.local.model_dir
        self.packed, self.quantization = self.local.packed, self.local.quantization
        self.int8_activations = self.local.int8_activations  # False: sharded weights are dense

    def _await(self, what: str) -> None:
        """Each worker's next message, which must be ``what``; a worker that dies or reports an error
        first raises ``TPWorkerError`` (no waiting on a dead process)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (c, p) in enumerate(zip(self.conns, self.procs), 1):
            while not c.poll(0.05):
                if not p.is_alive():
                    hint = f": {MAIN_GUARD_HINT}" if what == "started" else ""
                    raise TPWorkerError(f"tensor-parallel worker {rank} exited (exit code {p.exitcode}) before it "
                                        f"{what}{hint}")
                if time.monotonic() > deadline:
                    raise TPWorkerError(f"tensor-parallel worker {rank} did not get {what} within {START_TIMEOUT_S} s")
            status, info = c.recv()
            if status != what:
                raise TPWorkerError(f"tensor-parallel worker {rank} failed to start: {info}")

    def _worker_failure(self) -> str | None:
        """What went wrong on the workers (a dead process, a reported error), or None."""
        time.sleep(0.2)  # a dying worker's exit and message land
        for rank, (c, p) in enumerate(zip(self.conns, self.procs), 1):
            msg = None
            with contextlib.suppress(Exception):
                while c.poll(0):
                    got = c.recv()
                    if isinstance(got, tuple) and got and got[0] == "error":
                        msg = got[1]
            if msg is not None or not p.is_alive():
                code = "" if p.is_alive() else f" (exit code {p.exitcode})"
                return f"tensor-parallel worker {rank} failed{code}" + (f": {msg}" if msg else "")
        return None

    def _guarded(self, fn):
        """Run ``fn`` (a step on every rank) with Ctrl-C deferred; a failure stops the whole group."""
        if self.failed:
            raise TPWorkerError(f"this LLM's tensor-parallel group failed earlier ({self.failed}); create a new LLM")
        with sigint_deferred():
            try:
                return fn()
            except BaseException as e:
                why = self._worker_failure() or f"{type(e).__name__}: {e}"
                self.failed = why.splitlines()[0]
                self.shutdown()
                raise TPWorkerError(self.failed) from e

    def _call(self, name, *args, **kwargs):
        def run():
            for c in self.conns:
                c.send((name, args, kwargs))
            return getattr(self.local, name)(*args, **kwargs)

        return self._guarded(run)

    def _replies(self) -> list:
        return [c.recv() for c in self.conns]

    def forward(self, *args, **kwargs) -> StepOutput:
        return self._call("forward", *args, **kwargs)

    @torch.inference_mode()
    def move_slot(self, *args):
        return self._call("move_slot", *args)

    def compact(self, *args):
        return self._call("compact", *args)

    def reset_kv(self):
        return self._call("reset_kv")

    def release_slot(self, slot: int):
        return self._call("release_slot", slot)

    def swap_slots(self, a: int, b: int):
        return self._call("swap_slots", a, b)

    def share_prefix(self, slot: int, tokens: list[int]) -> int:
        return self._call("share_prefix", slot, tokens)

    def register_prefix(self, slot: int, tokens: list[int], length: int):
        return self._call("register_prefix", slot, tokens, length)

    @property
    def kv(self):
        return self.local.kv

    def attach(self, name, factory, *args, **kwargs) -> None:
        """Build the helper on every rank (``factory`` must be importable by name: it is pickled). The
        driver builds it first, so a failure (a bad checkpoint) is raised here before any worker tries."""
        self.local.attach(name, factory, *args, **kwargs)

        def send():
            for c in self.conns:
                c.send(("attach", (name, factory) + args, kwargs))

        self._guarded(send)

    def call_helper(self, name, method, *args, **kwargs):
        """Run ``method`` of helper ``name`` on every rank; the driver's result is returned."""
        return self._call("call_helper", name, method, *args, **kwargs)

    def helper(self, name: str):
        return self.local.helpers[name]

    def helper_report(self, name, method, *args, **kwargs) -> list:
        local = self._call("helper_report", name, method, *args, **kwargs)
        return local + self._guarded(self._replies)

    def collective_counts(self) -> list[dict]:
        local = self._call("collective_counts")
        return [local] + self._guarded(self._replies)

    @property
    def model(self):
        return self.local.model

    def shutdown(self) -> None:
        """Stop the workers: asked to leave, then terminated, then killed (a worker never outlives it)."""
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.send(None)
        deadline = time.monotonic() + 3
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self.conns, self.procs = [], []
        try:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
