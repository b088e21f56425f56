"""Long-context recall documents for ``bench lm_eval``'s side-by-side scores: what a KV codec, a prefill format or
a KV pool dtype changes must show up in a task score, so the task has to read the prompt's KV back.

A KV codec only touches the KV a decode pod receives, and only tokens generated on the decode pod read it (loglikelihood
requests are scored on the prefill pod from its own pool's KV, which an int8 pool changes too). So the documents are
key-value retrieval over ~1-1.5k tokens of prose: a few lines "The pass code of the WORD is NUMBER." hidden at random
depths of the repo's own docs/architecture.md, then a question about one of them. As a ``generate_until`` task the
answer must be generated (its first token on the prefill pod, every later one on the decode pod, from the transferred
KV); as a multiple-choice task the prefill pod scores each key's number as the continuation.

    build_docs(tokenizer, count, seed)   the documents, the same for the same text, tokenizer, count and seed

Every document holds its answer in its prompt ("The pass code of the WORD is NUMBER." verbatim) and its prompt is
at least ``MIN_PROMPT_TOKENS`` tokens with the model's tokenizer (tests/test_bench_recall_tasks.py).
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

FILLER_PATH = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
MIN_PROMPT_TOKENS = 1024
MAX_FILLER_TOKENS = 1400
KEYS_PER_DOC = 6
WORDS = ("apple", "river", "lamp", "garden", "violin", "mountain", "teacup", "harbor", "pencil", "window",
         "falcon", "meadow", "lantern", "castle", "orchard", "compass", "anchor", "blanket", "candle", "tunnel")
INSTRUCTION = ("Read the following text. Some lines in it give the pass code of a word; remember them, you will be "
               "asked for one.\n\n")


def filler_sentences(text: str) -> list[str]:
    """The prose sentences of a Markdown file: no headings, tables, lists or code, and no sentence holding a
    digit (a number in the filler would be a distractor the task does not mean to have)."""
    prose, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.strip() and not re.match(r"\s*([#|>*-]|\d+\.)", line):
            prose.append(line.strip())
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(prose))
    return [s for s in sentences if len(s) > 20 and not re.search(r"\d|`", s)]


def filler_fingerprint(text: str) -> str:
    """A short hash of the filler text, printed with every score: runs on different texts are different tasks."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def key_line(word: str, code: str) -> str:
    return f"The pass code of the {word} is {code}."


def build_docs(tokenizer, count: int, seed: int, text: str | None = None) -> list[dict]:
    """``count`` documents {"question", "answer", "choices", "gold"}: question and answer are the generate task's
    prompt and target (the code, which follows the question after a space); choices (every key's code in the
    document) and gold (the answer's index) the multiple-choice task's."""
    sentences = filler_sentences(FILLER_PATH.read_text() if text is None else text)
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        words = rng.sample(WORDS, KEYS_PER_DOC)
        codes = rng.sample(range(1000, 10000), KEYS_PER_DOC)
        target_tokens = rng.randint(MIN_PROMPT_TOKENS, MAX_FILLER_TOKENS)
        start, body, length = rng.randrange(len(sentences)), [], 0
        while length < target_tokens:
            sentence = sentences[(start + len(body)) % len(sentences)]
            body.append(sentence)
            length += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        for slot, (word, code) in zip(sorted(rng.sample(range(len(body) + 1), KEYS_PER_DOC), reverse=True),
                                      zip(words, codes)):
            body.insert(slot, key_line(word, str(code)))
        asked = rng.randrange(KEYS_PER_DOC)
        question = (INSTRUCTION + " ".join(body) + f"\n\nQuestion: What is the pass code of the {words[asked]}?\n"
                    f"Answer: The pass code of the {words[asked]} is")
        docs.append({"question": question, "answer": str(codes[asked]), "choices": [str(code) for code in codes],
                     "gold": asked})
    return docs
