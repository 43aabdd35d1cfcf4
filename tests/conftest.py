"""Shared fixtures: tiny random HF checkpoints (written by the tests, loaded by HF transformers as the
independent reference) and the real default model."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch

import specserve.config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# pytest-xdist's test processes (`make test` runs 2): the real model's tests share the cores among them,
# in this process and in every process a test starts (the CLI, servers, tensor-parallel workers read
# OMP_NUM_THREADS through torch's default): more threads than cores slow every process several times over
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
REAL_MODEL_THREADS = max(1, min(2, os.cpu_count() or 1) // _WORKERS)
os.environ["OMP_NUM_THREADS"] = str(REAL_MODEL_THREADS)


@pytest.fixture(scope="session")
def real_threads() -> int:
    """Threads for an engine of the real default model that a fixture builds (``REAL_MODEL_THREADS``)."""
    return REAL_MODEL_THREADS


@pytest.fixture(autouse=True)
def _speculation_gate_off(monkeypatch):
    """Engines made in tests draft on every step unless a test asks for the speculation gate: the gate
    decides from wall-clock rates, so the tests that count drafts (or check what drafted steps give)
    would depend on the machine's speed. ``tests/unit/test_spec_gate.py`` tests the gate itself."""
    monkeypatch.setattr("specserve.config.SPECULATION_GATE", False)


SHIPPED_SPECULATION_GATE = specserve.config.SPECULATION_GATE  # before any pin


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models (unit tests) run on 1 thread (their ops are too small to split, and a spare core keeps
    them fast when the machine is busy); the real default model (e2e, server) on this process's share
    of the cores (``REAL_MODEL_THREADS``)."""
    real = "unit" not in str(request.node.fspath)
    torch.set_num_threads(REAL_MODEL_THREADS if real else 1)
    yield
    if real:  # the real model's engines a test dropped: freed now
        gc.collect()

TINY_VOCAB = 257  # deliberately not a multiple of 8 (nor of tp_size)

TINY_CONFIGS = {
    "llama": dict(arch="LlamaForCausalLM", model_type="llama", tie_word_embeddings=True),
    "llama3-untied": dict(arch="LlamaForCausalLM", model_type="llama", tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(arch="Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=True, head_dim=32),
}


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0}
    vocab.update({f"w{i}": i for i in range(1, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))


def make_tiny_model(path: Path, kind: str = "llama", seed: int = 0, num_layers: int = 2,
                    vocab_size: int = TINY_VOCAB, hidden_size: int = 64) -> Path:
    """Save a tiny random model of ``kind`` as an HF directory (with a word-level tokenizer): 4 heads of
    ``hidden_size / 4`` (16 by default), 2 kv heads."""
    import transformers

    spec = dict(TINY_CONFIGS[kind])
    arch = spec.pop("arch")
    model_type = spec.pop("model_type")
    cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=10000.0, initializer_range=0.15, bos_token_id=None, eos_token_id=0,
                  architectures=[arch], **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so that they are tested too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny_model(root / k, k) for k in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs) -> Path:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def small_vocab_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a 16-token vocabulary: its sampled continuations have few enough
    outcomes for distribution tests, and drafts get accepted often enough to matter."""
    return make_tiny_model(tmp_path_factory.mktemp("small_vocab") / "m", "llama", seed=3, vocab_size=16)


def assert_replay_is_decoding(model_dir: Path, spec: dict, heldout_samples: list[dict], max_tokens: int,
                              decode: dict) -> None:
    """A trainer's greedy-decoding replay (``decode``) against the engine: greedy decoding with ``spec``
    on the held-out prompts gives the self-distilled responses in as many verification steps, with the
    same mean acceptance length up to the last step of each sequence."""
    from specserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=spec)
    gen = llm.generate([{"prompt_token_ids": h["ids"][: h["prompt_len"]]} for h in heldout_samples],
                       SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    assert [list(g.outputs[0].token_ids) for g in gen] == [h["ids"][h["prompt_len"]:] for h in heldout_samples]
    m = llm.get_metrics()
    assert m["num_verify_steps"] == decode["steps"], (m, decode)
    assert m["mean_acceptance_length"] == pytest.approx(decode["tau"], abs=0.02)


def assert_stopped_run_resumes(train, args_cls, module, prefix: str, base: dict, weights: str, tmp_path: Path,
                                cache_dir: Path, monkeypatch) -> tuple[dict, dict]:
    """The resume contract of a trainer ``train(args, log=...)`` whose module ``module`` makes its
    ``TrainState``: a run (3 epochs of ``base``, a state after every step) whose process dies right after
    saving in the middle of its second epoch, started again, continues from that state and writes bit for
    bit the ``weights`` file and step losses of an uninterrupted run, says so in its README and record;
    another learning rate does not pick that state up; ``resume=False`` starts over; the state
    (``{prefix}-*.pt``) goes when a run ends. Returns (uninterrupted, resumed) results."""
    from safetensors.torch import load_file

    quiet = lambda m: None  # noqa: E731
    ref = train(args_cls(out=str(tmp_path / "ref"), save_every_min=0, **base), log=quiet)
    per_epoch = ref["train"]["steps"] // 3
    stop_at = per_epoch + 2  # epoch 2, step 2
    assert base["epochs"] == 3 and per_epoch >= 3

    class Killed(Exception):
        pass

    real = module.TrainState

    class DiesAfterSaving(real):
        def save(self, st):
            super().save(st)
            if st["epoch"] * per_epoch + st["step"] == stop_at:
                raise Killed

    args = args_cls(out=str(tmp_path / "run"), save_every_min=1e-7, **base)  # a state after every step

    def killed_run(a):
        monkeypatch.setattr(module, "TrainState", DiesAfterSaving)
        with pytest.raises(Killed):
            train(a, log=quiet)
        monkeypatch.setattr(module, "TrainState", real)
        (f,) = cache_dir.glob(f"{prefix}-*.pt")
        return f

    state = killed_run(args)
    assert not (tmp_path / "run").exists()
    logs = []
    other = train(args_cls(**{**args.__dict__, "out": str(tmp_path / "o"), "lr": base["lr"] * 0.7}), log=logs.append)
    assert not any("resuming" in m for m in logs) and "resumed_at_steps" not in other["meta"]
    assert state.exists()  # not that run's state
    logs.clear()
    res = train(args, log=logs.append)
    assert sum(f"resuming training at epoch 2 step 2/{per_epoch} from {state}" in m for m in logs) == 1, logs
    assert not state.exists()
    assert res["train"]["step_loss"] == ref["train"]["step_loss"]
    assert res["train"]["epoch_loss"] == ref["train"]["epoch_loss"]
    w_ref, w_res = (load_file(str(tmp_path / d / weights)) for d in ("ref", "run"))
    assert set(w_ref) == set(w_res) and all(torch.equal(w_ref[k], w_res[k]) for k in w_ref)
    assert res["meta"]["resumed_at_steps"] == [stop_at] and res["train"]["train_s"] > res["train"]["train_s_before"] > 0
    readme = (tmp_path / "run" / "README.md").read_text()
    assert f"continued from its saved state at step {stop_at}: the same weights" in readme
    # resume=False: from the start (same result), and the stale state goes
    state = killed_run(args)
    logs.clear()
    again = train(args_cls(**{**args.__dict__, "resume": False}), log=logs.append)
    assert not any("resuming" in m for m in logs) and "resumed_at_steps" not in again["meta"]
    assert again["train"]["step_loss"] == ref["train"]["step_loss"] and not state.exists()
    with pytest.raises(ValueError, match="save_every_min"):
        args_cls(out="z", save_every_min=-1).validate()
    return ref, res


def hf_model(path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory) -> Path:
    """A prompts file of 60 random lines of tiny-vocabulary words (the trainers' --prompts)."""
    import random

    r = random.Random(0)
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("".join(" ".join(f"w{r.randint(1, 256)}" for _ in range(r.randint(3, 8))) + "\n"
                         for _ in range(60)))
    return p


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A training cache (self-distillation, target features) per test module."""
    return tmp_path_factory.mktemp("train_cache")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from specserve.models.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def ref_llm():
    """The HTTP tests' reference: offline plain decoding of the default model (never the engine a
    server runs: that one is its thread's)."""
    from specserve import LLM

    llm = LLM(num_threads=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_server():
    """A plain-decoding server of the default model (``tests/server/server_utils.serving``): (URL, state)."""
    from server_utils import serving  # tests/server: on the path when its tests run

    from specserve import LLM

    llm = LLM(num_threads=2)
    with serving(llm) as (url, state):
        yield url, state
    llm.shutdown()


@pytest.fixture(scope="session")
def default_llm_fp32():
    from specserve import LLM

    llm = LLM(dtype="float32")
    yield llm
    llm.shutdown()
