"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

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
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1,
                 speculative_config: dict | None = None, seed: int = 0, max_num_seqs: int = 16,
                 max_model_len: int | None = None, device: str | None = "auto", num_threads: int | None = None,
                 prefill_chunk: int = 512, quantization: str | None = "auto"):
        cfg = EngineConfig(speculative=SpeculativeConfig.from_dict(speculative_config), dtype=dtype,
                           quantization=quantization,
                           tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, seed=seed, num_threads=num_threads,
                           prefill_chunk=prefill_chunk)
        self.engine = LLMEngine(model, cfg, device)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    # ---- inputs -------------------------------------------------------------------------------
    def _normalize(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                out.append((p.get("prompt"), list(p["prompt_token_ids"])))
            elif isinstance(p, dict) and "prompt" in p:
                out.append((p["prompt"], self.tokenizer.encode(p["prompt"])))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")
        return out

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sp = list(sampling_params)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return sp

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        items = self._normalize(prompts)
        params = self._params_list(sampling_params, len(items))
        seqs = [self.engine.add_request(ids, p, text) for (text, ids), p in zip(items, params)]
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
        seq = self.engine.add_request(ids, sampling_params or SamplingParams(), text)
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


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="generate", file=sys.stderr, leave=False)
    except ImportError:
        return None
