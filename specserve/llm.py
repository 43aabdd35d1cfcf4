"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import gc
import sys
from typing import Iterator, Sequence as Seq

from specserve.config import EngineConfig, SamplingParams, SpeculativeConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.sequence import RequestOutput


class LLM:
    """An engine over one model.

    model: None (the embedded default model, SmolLM2-135M-Instruct), an HF directory or a .gguf file.
    dtype: "auto" (bfloat16 on GPUs and for quantized weights, else float32: see ``resolve_dtype``),
        "float32", "bfloat16".
    quantization: "auto" (a GGUF in its own quantization, an HF directory unquantized), None (dense),
        "gguf", "int8" or "int4" (weight-only, quantized at load: ``specserve.layers.quant``).
    tensor_parallel_size: processes the model is sharded over (gloo on CPU).
    device: "auto" (a CUDA GPU when torch sees one and tensor_parallel_size is 1, else the CPU;
        ``$SPECSERVE_DEVICE`` overrides), "cpu", "cuda" or "cuda:N".
    sampling_mode: "coupled" (default: at temperature > 0, a seeded request returns plain decoding's
        tokens for that seed, whatever the drafter, batch or tensor-parallel size) or "rejection"
        (vLLM's rejection sampler: exact in distribution only). See ``docs/sampling.md``.
    kv_cache_memory: GiB of paged KV cache (None: enough for max_num_seqs x max_model_len, at most a
        quarter of the machine's memory); pages become resident as blocks are used.
    enable_prefix_caching: requests that share a prompt prefix share its cached KV blocks (DSpark/DFlash,
        which read the target's features of every position, as far as a store of recent features holds
        them: ``engine.prefix_features``).
    speculation_gate: draft only at batch sizes where steps with drafts emit tokens faster than steps
        without (measured online: ``specserve.engine.spec_gate``); None (the default): on; False: every
        step drafts (what vLLM does).
    activations: what a quantized model's weights multiply: "bfloat16" (default: every product of a
        code and an activation exact) or "int8" (x in 8-bit groups of 32, as llama.cpp's kernels take it:
        cheaper verification, other tokens in places; quantization "gguf" or "int4", the C++ kernel on
        AVX-512 VNNI or AVX2). See ``docs/quantization.md``.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1,
                 speculative_config: dict | None = None, seed: int = 0, max_num_seqs: int = 16,
                 max_model_len: int | None = None, device: str | None = "auto", num_threads: int | None = None,
                 prefill_chunk: int = 512, quantization: str | None = "auto", sampling_mode: str = "coupled",
                 kv_cache_memory: float | None = None, enable_prefix_caching: bool = True,
                 speculation_gate: bool | None = None, activations: str = "bfloat16"):
        gc.collect()  # an engine dropped before this one (its model and drafter hold reference cycles) goes first
        cfg = EngineConfig(speculative=SpeculativeConfig.from_dict(speculative_config), dtype=dtype,
                           quantization=quantization, activations=activations,
                           tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, seed=seed, num_threads=num_threads,
                           prefill_chunk=prefill_chunk, sampling_mode=sampling_mode,
                           kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                           speculation_gate=speculation_gate)
        self.engine = LLMEngine(model, cfg, device)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    # ---- inputs -------------------------------------------------------------------------------
    def _normalize(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, a dict or a list of them, "
                            f"got {type(prompts).__name__}")
        return [self._one_prompt(p, i) for i, p in enumerate(prompts)]

    def _encode(self, text, i: int) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt {i}: the text must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt {i} is not valid text: {text[e.start]!r} at index {e.start} cannot be encoded "
                             "as UTF-8 (a lone surrogate)") from None
        return self.tokenizer.encode(text)

    def _one_prompt(self, p, i: int) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            return p, self._encode(p, i)
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return p.get("prompt"), _token_ids(p["prompt_token_ids"], i)
        if isinstance(p, dict) and "prompt" in p:
            return p["prompt"], self._encode(p["prompt"], i)
        if isinstance(p, dict):
            raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        if isinstance(p, (list, tuple)):
            return None, _token_ids(p, i)
        raise TypeError(f"prompt {i} must be a string, a list of token ids or a dict, got {type(p).__name__}")

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        sp = list(sampling_params)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        return sp

    def _add_all(self, items, params) -> list:
        """Queue every request or none: each is checked first, and a failure while queueing takes back
        what was queued, so the engine is left as it was."""
        for i, ((_, ids), p) in enumerate(zip(items, params)):
            try:
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}" if len(items) > 1 else str(e)) from None
        seqs = []
        try:
            for (text, ids), p in zip(items, params):
                seqs.append(self.engine.add_request(ids, p, text))
        except BaseException:
            for s in seqs:
                self.engine.abort(s)
            raise
        return seqs

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        items = self._normalize(prompts)
        params = self._params_list(sampling_params, len(items))
        seqs = self._add_all(items, params)
        bar = _progress(len(seqs)) if use_tqdm else None
        done = 0
        try:
            while self.engine.has_unfinished():
                self.engine.step()
                if bar:
                    n = sum(s.finished for s in seqs)
                    bar.update(n - done)
                    done = n
        except BaseException:
            for s in seqs:
                self.engine.abort(s)
            raise
        finally:
            if bar:
                bar.close()
        return [s.to_output() for s in seqs]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated; ``self.last_output`` holds the final result."""
        ((text, ids),) = self._normalize([prompt])
        (seq,) = self._add_all([(text, ids)], self._params_list(sampling_params, 1))
        shown = 0
        try:
            while not seq.finished:
                self.engine.step()
                visible = seq.stream_text()
                if len(visible) > shown:
                    yield visible[shown:]
                    shown = len(visible)
        finally:
            if not seq.finished:
                self.engine.abort(seq)
        if len(seq.text) > shown:
            yield seq.text[shown:]
        self.last_output = seq.to_output()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True):
        """``messages``: one conversation (list of {"role", "content"}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict:
        """Speculative decoding counters since start-up: num_drafts, num_draft_tokens,
        num_accepted_tokens, mean_acceptance_length (tokens per verification step, bonus included)
        and acceptance_rate_per_position."""
        return self.engine.get_metrics()

    def reset_metrics(self) -> None:
        self.engine.metrics = type(self.engine.metrics)()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _token_ids(ids, i: int) -> list[int]:
    """A prompt's token ids as a list of ints, or an error naming the prompt and the first bad id."""
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt {i}: token ids must be a list of ints, got {type(ids).__name__}")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"prompt {i}: token ids must be ints, got {t!r} ({type(t).__name__}) at index {j}")
    return list(ids)


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="generate", file=sys.stderr, leave=False)
    except ImportError:
        return None
