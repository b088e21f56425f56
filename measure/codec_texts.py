"""The texts a KV codec is measured on: GPL-3's text (``reference_tokens``: the perplexity windows and speed chunk of
``bench codecs``, the prompts of ``bench transfer`` and ``bench engine``'s perplexity) and the greedy-agreement
prompts (``agreement_prompts``) that ``bench codecs``, its ``--through-up`` run and ``scripts/codec_diagnosis.py``
share.

Agreement prompts: prose (module docs) and code (function sources) of the standard library, which comes with the
interpreter (the same text on every machine with the same Python, unlike anything downloaded), then long ones at the
lengths of the Azure conversation and code workloads: license texts and module sources.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.measure.workload import AZURE_LENGTHS

REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPT_LENS = (100, 300)  # shortest and longest short agreement prompt, in tokens
# Long agreement prompts take the workloads' prompt lengths (measure/workload.py) at evenly spaced quantiles, capped
# here (as bench serve's --max-prompt-tokens scales traces down to small machines).
LONG_PROMPT_CAP = 1024

PROSE_SOURCES = ("argparse", "json", "re", "statistics", "configparser", "socketserver", "hashlib", "wave", "uuid",
                 "urllib.request")  # modules: their docstrings
CODE_SOURCES = (("heapq", "merge"), ("textwrap", "TextWrapper._wrap_chunks"),
                ("difflib", "SequenceMatcher.find_longest_match"), ("json.encoder", "_make_iterencode"),
                ("collections", "namedtuple"), ("argparse", "ArgumentParser._parse_known_args"),
                ("shlex", "shlex.read_token"), ("csv", "Sniffer._guess_quote_and_delimiter"),
                ("configparser", "RawConfigParser._read"), ("fnmatch", "translate"))  # (module, qualname): sources
# Long prompts: prose from the other licenses Debian ships (two windows each), code from whole module sources.
LICENSE_TEXTS = ("Apache-2.0", "GPL-2", "LGPL-2.1", "MPL-2.0", "GFDL-1.3")
MODULE_SOURCES = ("difflib", "argparse", "typing", "dataclasses", "pathlib", "tarfile", "zipfile", "email.message",
                  "logging.handlers", "subprocess")


def reference_tokens(tokenizer: Tokenizer) -> list[int]:
    """GPL-3's text, tokenized: the fixed English text of the perplexity windows and the speed chunk (and of the
    transfer benchmark's prompts)."""
    if not REFERENCE_TEXT.is_file():
        raise SystemExit(f"{REFERENCE_TEXT} is missing: the benchmark's reference text (Debian's base-files "
                         "package ships it)")
    return tokenizer.encode(REFERENCE_TEXT.read_text())


def agreement_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts: the short ones (prose and code in turn, their lengths spread evenly over PROMPT_LENS),
    then the long ones (prose at the conversation workload's lengths, code at the code workload's, in turn)."""
    short_texts = [text for pair in zip(map(_module_doc, PROSE_SOURCES), (_source(*c) for c in CODE_SOURCES))
                   for text in pair]
    long_texts = [text for pair in zip(_license_windows(), map(_module_code, MODULE_SOURCES)) for text in pair]
    if not 1 <= count <= len(short_texts) + len(long_texts):
        raise SystemExit(f"--prompts must be in 1..{len(short_texts) + len(long_texts)}, got {count}")
    num_short = min(count, len(short_texts))
    shortest, longest = PROMPT_LENS
    lengths = [shortest + (longest - shortest) * i // max(1, num_short - 1) for i in range(num_short)]
    lengths += _workload_lengths(len(long_texts))
    prompts = []
    for i, (text, length) in enumerate(zip([*short_texts, *long_texts][:count], lengths)):
        tokens = tokenizer.encode(text)
        if len(tokens) < length:
            raise SystemExit(f"prompt {i} needs {length} tokens, its text has {len(tokens)}: {text[:60]!r}")
        prompts.append(tokens[:length])
    return prompts


def _workload_lengths(count: int) -> list[int]:
    """``count`` prompt lengths, conversation and code workload in turn, each at evenly spaced quantiles, capped."""
    workloads = [AZURE_LENGTHS[name][0] for name in ("azure-conv", "azure-code")]  # (prompt, output) lengths
    per_workload = -(-count // 2)
    return [min(LONG_PROMPT_CAP, workloads[i % 2].quantile((i // 2 + 0.5) / per_workload)) for i in range(count)]


def _license_windows() -> list[str]:
    texts = []
    for name in LICENSE_TEXTS:
        text = (REFERENCE_TEXT.parent / name).read_text()
        texts += [text, text[len(text) // 2:]]  # from the start and from the middle
    return texts


def _module_code(module: str) -> str:
    source = inspect.getsource(importlib.import_module(module))
    return source[re.search(r"^(def|class) ", source, re.MULTILINE).start():]  # past the header and docstring


def _module_doc(module: str) -> str:
    return importlib.import_module(module).__doc__ or ""  # None under python -OO: then the length check fails


def _source(module: str, qualname: str) -> str:
    obj = importlib.import_module(module)
    for attribute in qualname.split("."):
        obj = getattr(obj, attribute)
    return inspect.getsource(obj)
