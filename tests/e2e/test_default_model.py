"""The embedded default model (SmolLM2-135M-Instruct GGUF) against HF transformers' own GGUF loading."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ModelRunner
from specserve.models.gguf import GGUFFile
from specserve.models.loader import default_gguf_path
from specserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def hf_gguf():
    import transformers

    g = default_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    return tok, model


def test_gguf_tensors_equal_hf(hf_gguf):
    _, model = hf_gguf
    ref = model.state_dict()
    ours = dict(GGUFFile(default_gguf_path()).tensors())
    assert set(ours) == {k for k in ref if k != "lm_head.weight"}  # tied head
    for name, t in ours.items():
        assert torch.equal(t, ref[name].float()), name


def test_tokenizer_and_chat_template_match_hf(hf_gguf, default_model_dir):
    hf_tok, _ = hf_gguf
    ours = Tokenizer.from_dir(default_model_dir)
    for text in ["Hello world!", "The year 2024 had 366 days.", "  spaces\tand\nnewlines ",
                 "<|im_start|>user\nhi<|im_end|>",
                 "naïve café — déjà vu 😀", "def f(x):\n    return x**2"]:
        assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    want = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CHAT, tokenize=False) == want
    assert ours.eos_token_id == hf_tok.eos_token_id


def test_logits_and_greedy_tokens_match_hf(hf_gguf, default_model_dir, default_llm_fp32):
    _, model = hf_gguf
    ids = default_llm_fp32.tokenizer.apply_chat_template(CHAT)
    runner = ModelRunner(default_model_dir, dtype="float32", max_num_seqs=1)
    ours = runner.forward(0, [ids], [0], "all").logits[0]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3
    out = default_llm_fp32.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32,
                                                                                 ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert out[0].outputs[0].token_ids == g[0, len(ids):].tolist()


@pytest.mark.multiproc
def test_tp2_equals_tp1_on_default_model(default_llm_fp32):
    prompts = ["The capital of France is", "Once upon a time, in a small village,", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = default_llm_fp32.generate(prompts, params, use_tqdm=False)
    llm = LLM(dtype="float32", tensor_parallel_size=2)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_batched_greedy_equals_one_by_one(default_llm_fp32):
    prompts = ["Hi", "Tell me about the moon and the stars in the night sky.", "What is 2+2?", "Name three colors."]
    params = SamplingParams(temperature=0, max_tokens=20)
    batch = default_llm_fp32.generate(prompts, params, use_tqdm=False)
    for p, b in zip(prompts, batch):
        single = default_llm_fp32.generate([p], params, use_tqdm=False)[0]
        assert single.outputs[0].token_ids == b.outputs[0].token_ids


def test_chat_answers(default_llm_fp32):
    out = default_llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                                SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text and out[0].outputs[0].finish_reason == "stop"
    two = default_llm_fp32.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]],
                                SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(two) == 2


def test_peak_memory_of_one_long_prompt_does_not_depend_on_max_num_seqs():
    """Peak resident memory of a process that decodes one 2,000-token prompt on the default model:
    the same (within 5%) with max_num_seqs 1 and 16 (each in its own process)."""
    import subprocess
    import sys

    script = (
        "import resource, sys\n"
        "from specserve import LLM, SamplingParams\n"
        "llm = LLM(max_num_seqs=int(sys.argv[1]))\n"
        "ids = [(i * 7919) % 40000 + 100 for i in range(2000)]\n"
        "llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    peak = {}
    for seqs in (1, 16):
        out = subprocess.run([sys.executable, "-c", script, str(seqs)], capture_output=True, text=True, check=True)
        peak[seqs] = int(out.stdout.split()[-1])
    assert abs(peak[16] - peak[1]) < 0.05 * peak[1], peak
