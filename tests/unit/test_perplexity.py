"""``specserve perplexity``: the NLL of the engine's chunked forwards against HF transformers' full
forward, chunking, windows, weight-format names and the command on a tiny random model."""

import math
import random

import pytest
import torch
from conftest import hf_model


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    from specserve import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", quantization=None, max_num_seqs=1)
    yield llm
    llm.shutdown()


def random_ids(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randint(1, 256) for _ in range(n)]


def test_perplexity_is_exp_mean_nll_of_a_full_forward(tiny_llm, tiny_llama):
    """Windows of 64 tokens fed 16 at a time: exp(mean NLL) of HF's full forward over each window,
    every token after a window's first scored."""
    from specserve.bench.perplexity import perplexity

    ids = random_ids(150)
    got = perplexity(tiny_llm, ids, context=64, chunk=16)
    hf = hf_model(tiny_llama)
    total, n = 0.0, 0
    with torch.no_grad():
        for w0 in range(0, len(ids), 64):
            w = torch.tensor([ids[w0 : w0 + 64]])
            logits = hf(w).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits[:-1], w[0, 1:], reduction="sum").item()
            n += w.shape[1] - 1
    assert (got["tokens"], got["windows"]) == (n, 3) == (147, 3)
    assert got["nll"] == pytest.approx(total / n, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]), rel=1e-12)
    assert got["perplexity"] > 1


def test_perplexity_chunking_gives_one_chunks_result(tiny_llm):
    from specserve.bench.perplexity import perplexity

    ids = random_ids(100, seed=1)
    one = perplexity(tiny_llm, ids, context=100, chunk=100)
    for chunk in (1, 7, 16, 99):
        got = perplexity(tiny_llm, ids, context=100, chunk=chunk)
        assert got["tokens"] == one["tokens"] == 99
        assert got["nll"] == pytest.approx(one["nll"], rel=1e-5, abs=1e-6), chunk
    # another window size scores other contexts: a different number
    assert perplexity(tiny_llm, ids, context=10, chunk=4)["nll"] != pytest.approx(one["nll"], rel=1e-4)


def test_perplexity_windows():
    from specserve.bench.perplexity import BenchError, windows

    ids = list(range(10, 20))
    assert windows(ids, 4) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert windows(ids, 4, bos=1) == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18], [1, 19]]
    with pytest.raises(BenchError, match="--context"):
        windows(ids, 1, bos=1)


def test_perplexity_formats(tmp_path):
    from specserve.bench.perplexity import BenchError, default_formats, parse_formats

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    got = [(f.name, f.dtype, f.quantization) for f in parse_formats("float32,int8,bfloat16+int4,float32+none",
                                                                        str(hf_dir))]
    assert got == [("float32", "float32", None), ("int8", "auto", "int8"), ("bfloat16+int4", "bfloat16", "int4"),
                   ("float32+none", "float32", None)]
    assert default_formats(str(hf_dir)) == ["float32", "bfloat16", "int8", "int4"]
    assert default_formats(str(hf_dir), "cuda") == ["float32", "bfloat16"]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert default_formats(str(gguf))[-1] == "gguf"
    assert [f.quantization for f in parse_formats("gguf", str(gguf))] == ["gguf"]
    got = [(f.quantization, f.activations) for f in parse_formats("gguf,gguf-a8,int4-a8", str(gguf))]
    assert got == [("gguf", "bfloat16"), ("gguf", "int8"), ("int4", "int8")]
    for bad, msg in (("gguf", "needs a .gguf"), ("int3", "unknown format 'int3'"), ("float8+int8", "bad format"),
                     ("float32+int3", "bad format"), (" , ", "no format")):
        with pytest.raises(BenchError, match=msg):
            parse_formats(bad, str(hf_dir))


def test_perplexity_command_on_a_text_file(tiny_llama, tmp_path, capsys):
    """``specserve perplexity --text FILE``: a row per format with what `perplexity` computes on the
    file's first --max-tokens tokens; a missing file is a one-line error."""
    import json

    from specserve import LLM
    from specserve.bench.perplexity import perplexity
    from specserve.entrypoints.cli import main

    ids = random_ids(120, seed=2)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in ids) + "\n")
    out = tmp_path / "ppl.json"
    assert main(["perplexity", "--model", str(tiny_llama), "--formats", "float32", "--text", str(text),
                 "--max-tokens", "100", "--context", "64", "--chunk", "16", "--threads", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["format"], row["dtype"], row["quantization"], row["tokens"]) == ("float32", "float32", None, 98)
    llm = LLM(model=str(tiny_llama), dtype="float32", quantization=None, max_num_seqs=1)
    try:
        ref = perplexity(llm, ids[:100], context=64, chunk=64)
    finally:
        llm.shutdown()
    assert row["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
    printed = capsys.readouterr().out
    assert "perplexity" in printed and f"{row['perplexity']:.3f}" in printed
    assert main(["perplexity", "--model", str(tiny_llama), "--text", str(tmp_path / "nope.txt")]) == 2
    assert "error: --text: no such file" in capsys.readouterr().err
