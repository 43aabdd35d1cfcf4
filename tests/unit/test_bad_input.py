"""Bad input, one class per row: a one-line error that names the field, value or file and what is
expected; a refused batch leaves nothing behind in the engine."""

import json
import os
import shutil

import pytest

from specserve import LLM, SamplingParams
from specserve.config import UnsupportedModelError
from specserve.entrypoints.cli import main
from specserve.models.loader import CheckpointError

SAMPLING_ERRORS = [
    (dict(max_tokens=2.5), TypeError, "max_tokens must be an int or None, got 2.5"),
    (dict(max_tokens=True), TypeError, "max_tokens must be an int or None, got True"),
    (dict(top_k=1.5), TypeError, "top_k must be an int or None, got 1.5"),
    (dict(seed="abc"), TypeError, "seed must be an int or None, got 'abc'"),
    (dict(seed=2**70), ValueError, "seed must fit in 64 bits"),
    (dict(temperature="hot"), TypeError, "temperature must be a number, got 'hot'"),
    (dict(top_p=None), TypeError, "top_p must be a number, got None"),
    (dict(stop=5), TypeError, "stop must be a string or a list of strings, got 5"),
    (dict(stop_token_ids=["a"]), TypeError, "stop_token_ids must be an int, got 'a'"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos must be true or false, got 'yes'"),
    (dict(n=2), ValueError, "n > 1 is not supported"),
]


@pytest.mark.parametrize("kwargs, exc, message", SAMPLING_ERRORS)
def test_sampling_params_errors(kwargs, exc, message):
    with pytest.raises(exc) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


LLM_ERRORS = [
    (dict(max_model_len=-5), ValueError, "max_model_len must be >= 2"),
    (dict(max_model_len=0), ValueError, "max_model_len must be >= 2"),
    (dict(max_model_len=10**6), ValueError, "max_model_len (1000000) exceeds the model's max_position_embeddings"),
    (dict(max_model_len=8.5), TypeError, "max_model_len must be an int or None, got 8.5"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs must be an int, got 2.5"),
    (dict(tensor_parallel_size="2"), TypeError, "tensor_parallel_size must be an int, got '2'"),
    (dict(seed="x"), TypeError, "seed must be an int, got 'x'"),
    (dict(num_threads=0), ValueError, "num_threads must be >= 1"),
    (dict(sampling_mode="exact"), ValueError, "sampling_mode must be 'coupled' or 'rejection'"),
]


@pytest.mark.parametrize("kwargs, exc, message", LLM_ERRORS)
def test_llm_argument_errors(tiny_llama, kwargs, exc, message):
    with pytest.raises(exc) as e:
        LLM(model=str(tiny_llama), **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


REQUEST_ERRORS = [
    (["ok", ""], None, ValueError, "prompt 1: the prompt is empty"),
    ([[1, 2.5]], None, TypeError, "prompt 0: token ids must be ints, got 2.5 (float) at index 1"),
    ([[1, True]], None, TypeError, "prompt 0: token ids must be ints, got True (bool) at index 1"),
    (["ok", [1, 2, 100000]], None, ValueError, "prompt 1: prompt token ids out of range"),
    (["\ud800"], None, ValueError, "prompt 0 is not valid text: '\\ud800' at index 0 cannot be encoded as UTF-8"),
    ([{"text": "hi"}], None, ValueError, "prompt 0: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    ([3.5], None, TypeError, "prompt 0 must be a string, a list of token ids or a dict, got float"),
    (["ok"], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams or a list of them, got dict"),
    (["a", "b"], [SamplingParams(), {"seed": 1}], TypeError, "sampling_params[1] must be a SamplingParams, got dict"),
    (["a", "b"], [SamplingParams()], ValueError, "got 1 SamplingParams for 2 prompts"),
    (["ok", [5] * 299], None, ValueError, "prompt 1: prompt has 299 tokens; max_model_len is 256"),
]


@pytest.mark.parametrize("prompts, params, exc, message", REQUEST_ERRORS)
def test_a_bad_request_refuses_the_whole_batch(tiny_llama, prompts, params, exc, message):
    """The error names the request; the valid requests beside it are not queued, and the next
    ``generate`` decodes only what it is given (the same tokens as a fresh engine)."""
    llm = LLM(model=str(tiny_llama), max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(model=str(tiny_llama)).generate([[7, 8, 9]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(exc) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not llm.engine.waiting and not llm.engine.running
    out = llm.generate([[7, 8, 9]], greedy, use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].token_ids == want
    assert llm.engine.stats.prefill_tokens == 3  # nothing else was ever prefilled


def _bad_model(kind, tiny_llama, tmp_path):
    p = tmp_path / "m"
    shutil.copytree(tiny_llama, p)
    if kind == "random-safetensors":
        (p / "model.safetensors").write_bytes(os.urandom(4096))
    elif kind == "gpt2-without-tokenizer":
        (p / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
        (p / "tokenizer.json").unlink()
    elif kind == "truncated-safetensors":
        data = (p / "model.safetensors").read_bytes()
        (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    return p


MODEL_ERRORS = [
    ("random-safetensors", CheckpointError, "model.safetensors: not a valid safetensors file"),
    ("truncated-safetensors", CheckpointError, "model.safetensors: not a valid safetensors file"),
    ("gpt2-without-tokenizer", UnsupportedModelError, "unsupported architecture ['GPT2LMHeadModel']"),
]


@pytest.mark.parametrize("kind, exc, message", MODEL_ERRORS)
def test_bad_model_files(tiny_llama, tmp_path, capsys, kind, exc, message):
    """From the API: the error names the file; from the CLI: one line, exit 2, no traceback."""
    p = _bad_model(kind, tiny_llama, tmp_path)
    with pytest.raises(exc) as e:
        LLM(model=str(p))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["generate", "--model", str(p), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_truncated_gguf_names_the_file_and_tensor(tmp_path):
    from specserve.models.loader import default_gguf_path

    data = default_gguf_path().read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor '.*' runs past the end of the file"):
        LLM(model=str(p))
