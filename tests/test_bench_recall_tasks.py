"""The recall documents of ``bench lm_eval``'s side-by-side scores (bench/lm_eval/recall_tasks.py): the same for the
same seed, every answer really in its prompt and nowhere else as a candidate, and every prompt at least 1k tokens with
the real SmolLM2 tokenizer, so the KV that a codec compresses is long."""

from __future__ import annotations

import re

import pytest

from splitserve.bench.lm_eval import recall_tasks
from splitserve.engine.text.tokenizer_files import load_tokenizer


@pytest.mark.model
def test_documents_are_deterministic_hold_their_answer_and_are_long():
    tokenizer = load_tokenizer("smollm2-135m")
    docs = recall_tasks.build_docs(tokenizer, 8, seed=7)
    assert docs == recall_tasks.build_docs(tokenizer, 8, seed=7)
    assert docs != recall_tasks.build_docs(tokenizer, 8, seed=8)
    for doc in docs:
        question = doc["question"]
        asked = re.fullmatch(r".*The pass code of the (\w+) is", question, re.DOTALL).group(1)
        assert question.count(f"the {asked} is ") == 1  # one key line names the asked word
        assert recall_tasks.key_line(asked, doc["answer"]) in question
        assert doc["choices"][doc["gold"]] == doc["answer"]
        # Every choice is a key of this document, and the filler holds no other number to confuse them with.
        assert sorted(re.findall(r"\d+", question)) == sorted(doc["choices"])
        assert len(set(doc["choices"])) == recall_tasks.KEYS_PER_DOC
        assert len(tokenizer.encode(question, add_special_tokens=False)) >= recall_tasks.MIN_PROMPT_TOKENS


def test_filler_is_prose_without_numbers_or_markup():
    text = "# Title\n\nFirst sentence of prose here. Second one has 3 digits.\n\n```\ncode = 1\n```\n| a | b |\n" \
           "- a list item that is long enough\nA line with `code` in it, long enough.\nLast real sentence is this."
    assert recall_tasks.filler_sentences(text) == ["First sentence of prose here.", "Last real sentence is this."]
