"""Our decoder vs HF transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

import pytest
import torch

from conftest import TINY_CONFIGS, hf_model
from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ModelRunner

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 101]]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_logits_match_hf(tiny_dirs, kind):
    path = tiny_dirs[kind]
    ref = hf_model(path)
    runner = ModelRunner(path, dtype="float32", max_num_seqs=4)
    for i, p in enumerate(PROMPTS):
        ours = runner.forward(i, [p], [0], "all").logits[0]
        with torch.no_grad():
            theirs = ref(torch.tensor([p])).logits[0].float()
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 1e-4, kind


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_greedy_batch_matches_hf(tiny_dirs, kind):
    path = tiny_dirs[kind]
    ref = hf_model(path)
    llm = LLM(model=str(path), dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            g = ref.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        assert o.outputs[0].token_ids == g[0, len(p):].tolist(), kind
        assert o.prompt_token_ids == p


def test_incremental_decode_logits_match_full_forward(tiny_llama):
    """Chunked prefill + one-token steps give the logits of one full forward."""
    runner = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=2)
    seq = PROMPTS[2] + [9, 8, 7, 6]
    full = runner.forward(0, [seq], [0], "all").logits[0]
    runner.forward(1, [seq[:5]], [0], "none")
    part = runner.forward(1, [seq[5:9]], [5], "all").logits[0]
    steps = [runner.forward(1, [[t]], [i], "last").logits[0] for i, t in enumerate(seq[9:], start=9)]
    inc = torch.cat([part, torch.stack(steps)])
    assert (inc - full[5:]).abs().max().item() < 1e-5


def test_bf16_close_to_fp32(tiny_llama):
    a = ModelRunner(tiny_llama, dtype="float32").forward(0, [PROMPTS[0]], [0], "all").logits
    b = ModelRunner(tiny_llama, dtype="bfloat16").forward(0, [PROMPTS[0]], [0], "all").logits
    assert b.dtype == torch.float32  # logits are returned in float32 whatever the weights
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_aux_layers_match_hf_hidden_states_in_requested_order(tiny_llama):
    """Layer outputs come back in the order asked for; output of layer i is HF's hidden_states[i + 1]."""
    from specserve.layers.attention import ForwardContext

    ref = hf_model(tiny_llama)
    runner = ModelRunner(tiny_llama, dtype="float32")
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        _, aux = runner.model(ids, pos, ForwardContext(kv=None), aux_layers=(1, 0))
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    assert torch.allclose(aux[1], hs[1], atol=1e-4)
    # layer 1 is the last one: HF's last hidden state is after the final norm, ours before it
    with torch.inference_mode():
        assert torch.allclose(runner.model.model.norm(aux[0]), hs[2], atol=1e-4)
