"""``splitserve bench llamacpp``: without llama-cpp-python it still measures splitserve's side (on the tiny model),
and says llama.cpp is absent; with the package, llama.cpp's side decodes the real GGUF file and makes tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest

from splitserve.bench import llamacpp as llamacpp_bench
from splitserve.engine.text.tokenizer_files import smollm2_gguf_path

SMALL = ["--threads", "1", "--max-tokens", "4", "--parallel", "2", "--repeats", "1", "--lookup-prompts", "1"]


@pytest.mark.e2e
def test_without_llama_cpp_the_bench_measures_splitserve_and_says_llama_cpp_is_absent(tmp_path, capsys,
                                                                                       monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "llama_cpp"
                        else find_spec(name, *args))
    out = tmp_path / "llamacpp.json"
    llamacpp_bench.main(["--model", "tiny-random", "--quantizations", "none", "--int8-activations", "int4", *SMALL,
                         "--json", str(out)])
    results = json.loads(out.read_text())
    assert results["llamacpp"].startswith("absent: llama-cpp-python is not installed")
    assert [(row["side"], row["threads"]) for row in results["decode"]] == [("splitserve none", 1),
                                                                            ("splitserve int4 int8-act", 1)]
    for decode in results["decode"]:
        assert min(decode[key]["median"] for key in ("batch1_ms", "batch1_best_ms", "parallel_tok_s")) > 0
    assert [row["side"] for row in results["lookup"]] == ["splitserve ngram"]
    lookup = results["lookup"][0]
    assert lookup["off_tok_s"]["median"] > 0 and lookup["on_tok_s"]["median"] > 0
    table_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("splitserve none "))
    assert table_row.count("absent") == 3  # every ratio column


@pytest.mark.e2e
def test_a_side_that_fails_comes_back_as_its_error():
    job = {"side": "splitserve", "task": "decode", "model": "no-such-model", "quantization": "none", "threads": 1,
           "max_tokens": 3, "parallel": 1}
    assert llamacpp_bench.run_pinned(job, [0])["error"].startswith("ValueError: unknown model 'no-such-model'")


@pytest.mark.e2e
@pytest.mark.model
def test_the_llama_cpp_side_decodes_the_gguf_file():
    """With llama-cpp-python installed (the optional extra), llama.cpp's side makes tokens at batch 1 and in
    parallel, and with and without prompt lookup."""
    pytest.importorskip("llama_cpp", reason="the optional llamacpp extra is not installed")
    job = {"model_path": str(smollm2_gguf_path()), "threads": 1, "max_tokens": 4, "parallel": 2}
    decode = llamacpp_bench.run_pinned({**job, "side": "llamacpp", "task": "decode"}, [0])
    assert decode["batch1_ms"] > 0 and decode["parallel_tok_s"] > 0, decode
    for lookup in (False, True):
        figures = llamacpp_bench.run_pinned({**job, "side": "llamacpp", "task": "lookup", "prompts": 1, "k": 4,
                                             "lookup": lookup}, [0])
        assert figures.get("tokens") == 3 and figures["tok_s"] > 0, figures  # 4 tokens, the first from prefill
