"""The benchmark harness: method names, interleaving the methods prompt by prompt, weight formats and
the llama.cpp row (driven by a fake ``llama_cpp`` module)."""

from typing import ClassVar

import pytest


def test_bench_presets_are_a_plain_table():
    from specserve.bench.harness import PRESETS, BenchError, method_factory, parse_methods

    assert parse_methods("dspark-tree-pool,none") == ["none", "dspark-tree-pool"]
    row = method_factory("dspark-tree-pool")()
    assert row.name == "dspark-tree-pool"
    pool = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
    assert row.speculative_config == {"method": "dspark", "dspark_tree": "auto", **pool}
    assert method_factory("medusa-tree-dynamic-pool")().speculative_config == {
        "method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **pool}
    assert method_factory("dflash-draft-int4")().speculative_config == {"method": "dflash",
                                                                        "draft_quantization": "int4"}
    assert method_factory("none")().speculative_config is None
    row.speculative_config["model"] = "x"  # a row's config is its own copy
    assert "model" not in PRESETS["dspark-tree-pool"]
    for bad in ("medusa-tree-64", "dspark-tree-12-ngram", "dspark@ck", "medusa-pool8", "dspark-draft-float32"):
        with pytest.raises(BenchError, match="unknown method.*--speculative-config NAME=JSON"):
            parse_methods(bad)


def test_bench_speculative_config_rows():
    """``--speculative-config NAME=JSON``: a row of any configuration, e.g. another drafter checkpoint
    beside the shipped one."""
    from specserve.bench.harness import BenchError, method_factory, parse_configs, parse_methods

    configs = parse_configs(['old={"method": "dspark", "model": "ck/a", "dspark_tree": 12}',
                             'big={"method": "medusa", "medusa_tree": 64}'])
    assert configs["old"] == {"method": "dspark", "model": "ck/a", "dspark_tree": 12}
    assert parse_methods("dspark,old", configs) == ["none", "dspark", "old", "big"]  # configured rows run
    row = method_factory("old", configs)()
    assert row.name == "old" and row.speculative_config == configs["old"]
    for bad, why in (("old", "NAME=JSON"), ("=x", "NAME=JSON"), ("a,b={}", "NAME=JSON"),
                     ("dspark={\"method\": \"dspark\"}", "preset's name"), ("x={oops", "not valid JSON"),
                     ("x=[1]", "method"), ('x={"model": "m"}', "method")):
        with pytest.raises(BenchError, match=why):
            parse_configs([bad])


def test_bench_interleaves_methods_prompt_by_prompt():
    """All methods load first, then every prompt goes through every method (order rotating), and the
    results equal a one-method-after-the-other run; sessions are closed either way."""
    from specserve.bench.harness import BenchContext, MethodResult, Session, _run_methods, run_alone

    calls, closed = [], []

    class FakeSession(Session):
        def __init__(self, ctx, name):
            super().__init__(ctx)
            self.name = name
            calls.append(("start", name))

        def _generate(self, ids, n, i):
            calls.append((self.name, i))
            return [len(self.name), i]

        def close(self):
            closed.append(self.name)

    class Fake:
        def __init__(self, name):
            self.name = name

        def start(self, ctx):
            return FakeSession(ctx, self.name)

        def run(self, ctx):
            return run_alone(self, ctx)

    ctx = BenchContext(None, None, "float32", [[1], [2], [3], [4]], [], 8, 0.0, 0, 1)
    names = ["none", "a", "bb"]
    runners = {n: Fake(n) for n in names}
    got = _run_methods(runners, names, ctx, True, lambda s: None)
    assert calls[:3] == [("start", n) for n in names]
    assert calls[3:] == [("none", 0), ("a", 0), ("bb", 0), ("a", 1), ("bb", 1), ("none", 1),
                         ("bb", 2), ("none", 2), ("a", 2), ("none", 3), ("a", 3), ("bb", 3)]
    assert sorted(closed) == sorted(names)
    calls.clear()
    closed.clear()
    alone = _run_methods(runners, names, ctx, False, lambda s: None)
    assert [c for c in calls if c[0] != "start"] == [(n, i) for n in names for i in range(4)]
    assert sorted(closed) == sorted(names)
    for n in names:
        assert isinstance(got[n], MethodResult)
        assert got[n].outputs == alone[n].outputs == [[len(n), i] for i in range(4)]


def test_bench_heldout_prompt_sets():
    """The bench's held-out prompt sets are the trainers' held-out splits, disjoint from what they train on."""
    from specserve.bench.harness import load_prompts
    from specserve.train.data import load_prompts as load_chitchat
    from specserve.train.instructions import load_instruction_prompts

    chat = load_prompts("chitchat-heldout")
    assert chat == load_chitchat("heldout") and not set(chat) & set(load_chitchat("train"))
    instr = load_prompts("instructions-heldout")
    assert instr == load_instruction_prompts("heldout") and len(instr) >= 20
    assert not set(instr) & set(load_instruction_prompts("train"))


# ---- weight formats, the llama.cpp row ----------------------------------------------------------------
def test_bench_llamacpp_method_names():
    """``llama.cpp`` and its alias ``llamacpp`` name one row; it takes no drafter suffixes."""
    from specserve.bench.harness import BenchError, LlamaCppMethod, method_factory, parse_methods

    assert parse_methods("llamacpp,none") == ["none", "llama.cpp"]
    assert parse_methods("none,llama.cpp,llamacpp,hf") == ["none", "llama.cpp", "hf"]
    row = method_factory("llamacpp")()
    assert isinstance(row, LlamaCppMethod) and row.name == "llama.cpp"
    for bad in ("llama.cpp@x", "llama.cpp-ngram", "llamacpp-pool", "llama.cpp-tree-4", "llama",
                "llama.cpp-draft-float32"):
        with pytest.raises(BenchError, match="unknown method"):
            parse_methods(bad)


def test_bench_weight_formats_are_dtype_by_quantization_pairs(tmp_path):
    """``--dtype A,B --quantization X,Y``: every pair, dtype by dtype, resolved and deduplicated; an HF
    directory has no GGUF blocks to run."""
    from specserve.bench.harness import BenchError, parse_formats

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert parse_formats("float32,bfloat16", "none,int8,none", str(hf_dir)) == [
        ("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8")]
    assert parse_formats("float32", "auto,none", str(hf_dir)) == [("float32", None)]  # auto: dense for HF
    assert parse_formats(["float32"], ["int4"], str(hf_dir)) == [("float32", "int4")]
    with pytest.raises(BenchError, match="gguf"):
        parse_formats("float32", "gguf", str(hf_dir))
    with pytest.raises(BenchError, match="unknown quantization 'int3'"):
        parse_formats("float32", "none,int3", str(hf_dir))
    with pytest.raises(BenchError, match="unknown dtype 'float8'"):
        parse_formats("float8", "none", str(hf_dir))
    with pytest.raises(BenchError, match="no quantization"):
        parse_formats("float32", " , ", str(hf_dir))


def test_cli_quantization_flags_reach_the_engine(monkeypatch):
    """``--quantization`` on generate, bench, demo and perplexity: parsed, "none" -> None, passed on."""
    from specserve.bench import perplexity
    from specserve.entrypoints import cli

    parse = cli.build_parser().parse_args
    assert parse(["generate", "--prompt", "hi"]).quantization == "auto"
    assert parse(["generate", "--prompt", "hi", "--quantization", "int4"]).quantization == "int4"
    assert parse(["demo", "--quantization", "none"]).quantization == "none"
    assert parse(["bench", "--quantization", "none,int8", "--dtype", "float32,bfloat16"]).quantization == "none,int8"
    px = parse(["perplexity", "--formats", "float32,int8", "--max-tokens", "64", "--threads", "1"])
    assert (px.formats, px.max_tokens, px.threads, px.dtype, px.quantization) == ("float32,int8", 64, 1, None, None)
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "hi", "--quantization", "int3"])
    assert cli.quantization_arg("none") is None and cli.quantization_arg("int8") == "int8"

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(cli, "LLM", fake_llm)
    with pytest.raises(Stop):
        cli.cmd_generate(parse(["generate", "--prompt", "hi", "--quantization", "none"]))
    assert "quantization" in seen and seen["quantization"] is None
    with pytest.raises(Stop):
        cli.cmd_demo(parse(["demo", "--quantization", "int8", "--dtype", "bfloat16"]))
    assert (seen["quantization"], seen["dtype"]) == ("int8", "bfloat16")

    def fake_bench(**kw):
        seen["bench"] = kw
        raise Stop

    monkeypatch.setattr(cli, "run_bench", fake_bench)
    with pytest.raises(Stop):
        cli.cmd_bench(parse(["bench", "--quantization", "none,int4", "--dtype", "float32,bfloat16"]))
    assert (seen["bench"]["quantizations"], seen["bench"]["dtypes"]) == ("none,int4", "float32,bfloat16")

    def fake_eval(**kw):
        seen["px"] = kw
        raise Stop

    monkeypatch.setattr(perplexity, "evaluate", fake_eval)
    with pytest.raises(Stop):
        cli.cmd_perplexity(parse(["perplexity", "--dtype", "float32", "--quantization", "int8"]))
    assert seen["px"]["formats"] == ["float32+int8"]
    assert cli.main(["perplexity", "--formats", "int8", "--quantization", "int4"]) == 2  # one way or the other


def test_bench_llamacpp_missing_package_fails_before_loading(monkeypatch, capsys):
    """Without llama-cpp-python the bench stops with one line saying how to install it, before any
    model loads."""
    import sys

    from specserve.bench import harness
    from specserve.entrypoints import cli

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError

    def must_not_load(*a, **k):
        raise AssertionError("loaded something before the check")

    monkeypatch.setattr(harness, "resolve_model_dir", must_not_load)
    monkeypatch.setattr(harness, "SpecserveSession", must_not_load)
    with pytest.raises(harness.BenchError) as e:
        harness.run_bench(methods="none,llamacpp", dtypes="float32", quantizations="none")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("llama.cpp row: llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36")
    assert cli.main(["bench", "--methods", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: llama.cpp row: llama-cpp-python is not installed") and err.count("\n") == 1


class FakeLlama:
    """``llama_cpp.Llama`` as the bench uses it: records its settings and generate calls, and generates
    ``prompt[-1] + 1, + 2, ...`` (the EOS id 0 after ``eos_after`` tokens, when set). Like
    llama-cpp-python, ``generate`` keeps the longest prefix of the prompt (never its last token) that the
    cache holds from the request before (the tokens it evaluated: the prompt and all but the last
    generated token), recorded as ``kept``."""

    instances: ClassVar[list] = []
    eos_after: ClassVar[int | None] = None

    def __init__(self, model_path, **kw):
        self.model_path, self.kw, self.calls = model_path, kw, []
        self.input_ids: list[int] = []
        FakeLlama.instances.append(self)

    def reset(self):
        self.calls.append(("reset",))
        self.input_ids = []

    def set_seed(self, seed):
        self.calls.append(("seed", seed))

    def generate(self, tokens, reset=True, **kw):
        assert reset, "llama-cpp-python keeps a shared prefix only with reset=True"
        kept = 0
        for a, b in zip(self.input_ids, tokens[:-1]):
            if a != b:
                break
            kept += 1
        self.calls.append(("generate", list(tokens), kw, kept))
        self.input_ids = list(tokens)
        k, last = 0, None
        while True:  # like llama.cpp: never stops by itself
            k += 1
            if last is not None:
                self.input_ids.append(last)  # evaluated when the next token is asked for
            last = 0 if k == self.eos_after else tokens[-1] + k
            yield last

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("llama_cpp")
    mod.Llama = FakeLlama
    mod.__version__ = "0.0-fake"
    FakeLlama.instances = []
    FakeLlama.eos_after = None
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    return mod


def test_bench_llamacpp_needs_a_gguf_one_process_and_the_cpu(fake_llama_cpp, tmp_path):
    from specserve.bench.harness import BenchError, LlamaCppMethod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    m = LlamaCppMethod()
    m.check(model=str(gguf))  # a .gguf: fine
    with pytest.raises(BenchError, match=r"llama.cpp needs a \.gguf model, got --model .*hf"):
        m.check(model=str(tmp_path / "hf"))
    with pytest.raises(BenchError, match="one process"):
        m.check(model=str(gguf), tensor_parallel_size=2)
    with pytest.raises(BenchError, match="on the CPU"):
        m.check(model=str(gguf), device="cuda")


def test_bench_llamacpp_session_feeds_our_prompt_ids_greedy_keeping_the_shared_prefix(fake_llama_cpp, tmp_path):
    """The row's llama.cpp gets the bench's prompt ids as they are, greedy settings, the thread count
    for prompt and generation, its cache never reset (a request keeps the prefix it shares with the one
    before, as our rows' prefix caching does), and stops at EOS or max_tokens."""
    from specserve.bench.harness import WARMUP_TOKENS, BenchContext, LlamaCppMethod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = [[5, 6, 7], [5, 6, 11, 12, 13, 14], [20]]
    ctx = BenchContext(str(gguf), tmp_path, "float32", prompts, [0], 5, 0.0, 0, 3)
    session = LlamaCppMethod().start(ctx)
    (llama,) = FakeLlama.instances
    assert llama.model_path == str(gguf)
    kw = llama.kw
    assert kw["n_threads"] == kw["n_threads_batch"] == 3
    assert kw["verbose"] is False and kw["logits_all"] is False
    assert kw["n_ctx"] >= 6 + 5
    FakeLlama.eos_after = 2  # from now on: EOS as the 2nd token
    session.generate(1)
    FakeLlama.eos_after = None
    session.generate(0)
    session.generate(2)
    res = session.result()
    assert res.outputs == [[8, 9, 10, 11, 12], [15, 0], [21, 22, 23, 24, 25]]  # max_tokens 5, EOS kept
    gens = [c for c in llama.calls if c[0] == "generate"]
    assert [g[1] for g in gens] == [prompts[0], prompts[1], prompts[0], prompts[2]]  # warm-up first
    for _, _, g, _ in gens:
        assert g["temp"] == 0.0 and g["top_k"] == 1 and g["repeat_penalty"] == 1.0
    assert [g[3] for g in gens] == [0, 2, 2, 0]  # the prefix each shares with the request before
    assert [c[0] for c in llama.calls] == ["generate"] * 4  # never a reset
    assert len(session.outputs) == 3 and session.wall > 0
    assert res.extra["n_threads"] == 3 and res.extra["llama_cpp_version"] == "0.0-fake"
    session.close()
    assert llama.calls[-1] == ("close",)
    assert WARMUP_TOKENS < 5


def test_bench_llamacpp_sampled_rows_seed_each_request(fake_llama_cpp, tmp_path):
    from specserve.bench.harness import BenchContext, LlamaCppMethod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    ctx = BenchContext(str(gguf), tmp_path, "float32", [[1], [2]], [0], 3, 0.7, 10, 2)
    session = LlamaCppMethod().start(ctx)
    session.generate(1)
    llama = FakeLlama.instances[0]
    assert ("seed", 11) in llama.calls
    g = [c for c in llama.calls if c[0] == "generate"][-1][2]
    assert g["temp"] == 0.7 and g["top_k"] == 0 and g["top_p"] == 1.0 and g["min_p"] == 0.0


def test_bench_run_with_a_llamacpp_row(fake_llama_cpp, monkeypatch, tmp_path):
    """run_bench end to end with a fake llama.cpp and a fake plain row: llama.cpp gets the chat-template
    ids our rows get, every row has tok/s over llama.cpp's, the identity is informational, the
    table has the 'vs llama.cpp' column."""
    import json
    import time
    import types

    from conftest import write_tiny_tokenizer

    from specserve.bench import harness

    model_dir = tmp_path / "dir"
    model_dir.mkdir()
    write_tiny_tokenizer(model_dir, 40)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2\nw3 w4 w5\n")
    monkeypatch.setattr(harness, "resolve_model_dir", lambda m: model_dir)
    monkeypatch.setattr(harness, "read_config", lambda d: types.SimpleNamespace(eos_token_id=0))
    seen = []

    class PlainSession(harness.Session):
        def __init__(self, ctx):
            super().__init__(ctx)
            seen.append((ctx.dtype, ctx.quantization, ctx.prompt_ids))

        def _generate(self, ids, n, i):
            time.sleep(0.002)  # slower than the fake llama.cpp
            return [ids[-1] + 1, 0] if i == 1 else [ids[-1] + k for k in range(1, n + 1)]

    class Plain:
        name = "none"

        def start(self, ctx):
            return PlainSession(ctx)

    monkeypatch.setitem(harness.PEERS, "none", Plain)  # a peer's name is looked up first
    rows = harness.run_bench(model=str(gguf), methods="llamacpp", prompts_file=str(prompts), max_tokens=4,
                             dtypes="float32", quantizations="none", threads=2)
    (dtype, quant, ids), = seen
    assert (dtype, quant) == ("float32", None)
    assert ids == [[1, 2], [3, 4, 5]]  # the tiny chat template: the words' ids (and a space)
    llama = FakeLlama.instances[0]
    assert [c[1] for c in llama.calls if c[0] == "generate"][1:] in ([ids[0], ids[1]], [ids[1], ids[0]])
    assert llama.kw["n_threads"] == 2
    none, lc = rows
    assert (none["method"], lc["method"]) == ("none", "llama.cpp")
    assert (none["weights"], lc["weights"], lc["quantization"]) == ("dense", "gguf", "gguf")
    assert lc["speedup_vs_llamacpp"] == 1.0
    assert none["speedup_vs_llamacpp"] == pytest.approx(none["tokens_per_s"] / lc["tokens_per_s"], rel=1e-3, abs=1e-4)
    assert none["speedup_vs_llamacpp"] < 1  # the fake llama.cpp does not sleep
    # plain: [3, 4, 5, 6] and [6, 0]; llama.cpp: [3, 4, 5, 6] and [6, 7, 8, 9] -> one prompt differs
    assert lc["identical_to_none"] is None and lc["identity_informational"] is True
    assert lc["divergent_prompts"] == 1 and lc["mean_common_prefix_tokens"] == 2.5
    table = harness.format_table(rows)
    head, _, r_none, r_lc = table.splitlines()
    assert "vs llama.cpp" in head and "weights" in head
    assert "info: 1 differ" in r_lc and "NO" not in r_lc
    assert f"{none['speedup_vs_llamacpp']:.2f}x" in r_none
    json.dumps(rows)  # the JSON file takes every row
    # without a llama.cpp row: no such column
    assert "vs llama.cpp" not in harness.format_table([{k: v for k, v in none.items() if k != "speedup_vs_llamacpp"}])
