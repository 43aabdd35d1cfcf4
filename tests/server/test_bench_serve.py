"""``specserve bench-serve``'s pieces: percentiles, configurations, and one small run against a server
in this process (table rows, a PNG, the JSON)."""

import json

import pytest

from specserve import LLM
from specserve.bench.serve_bench import BenchServeError, format_table, parse_configs, percentiles, plot, run, write_json

from server_utils import serving


def test_percentiles_and_configs():
    assert percentiles(list(range(1, 101))) == (50, 90, 99)
    assert percentiles([3.0]) == (3.0, 3.0, 3.0) and percentiles([]) == (0.0, 0.0, 0.0)
    assert parse_configs("none,ngram")[0] == ("none", None) and parse_configs("none,ngram")[1][1]["method"] == "ngram"
    assert parse_configs('a={"method": "ngram"}; b={"method": "medusa"}') == [("a", {"method": "ngram"}),
                                                                            ("b", {"method": "medusa"})]
    with pytest.raises(BenchServeError, match="unknown configuration 'eagle'"):
        parse_configs("none,eagle")


@pytest.mark.slow
def test_a_small_run(tmp_path, real_threads):
    llm = LLM(num_threads=real_threads)
    try:
        with serving(llm) as (url, _):
            rows = run([("plain", url + "/v1")], [], [1, 2], 2, 6, ["Hi", "Name a color."], [], None, True,
                       log=lambda m: None)
    finally:
        llm.shutdown()
    assert [(r.server, r.concurrency, r.requests, r.errors) for r in rows] == [("plain", 1, 2, 0), ("plain", 2, 2, 0)]
    assert all(r.output_tokens == 12 and r.output_tok_s > 0 and r.ttft_ms[0] > 0 and r.itl_ms[0] > 0 for r in rows)
    assert "| 2 | plain | 2 |" in format_table(rows)
    plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    write_json(rows, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())[1]["concurrency"] == 2


def test_usage_errors(capsys):
    from specserve.entrypoints.cli import main

    assert main(["bench-serve", "--server", "no-url"]) == 2
    assert "expected LABEL=URL" in capsys.readouterr().err
    assert main(["bench-serve", "--configs", "none", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["serve", "a_model_dir", "--model", "another"]) == 2
    assert "two models given" in capsys.readouterr().err
