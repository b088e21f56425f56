"""Tokenizer: byte-level BPE from GGUF data and from HF directories, chat templates. Fast tests use tiny-random's
byte tokenizer, where every byte is one token; model-marked ones use SmolLM2's real vocabulary."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import load_tokenizer, smollm2_gguf_path, tiny_random_tokenizer_data
from splitserve.engine.weights.gguf_file import load_gguf

IM_START, IM_END = 1, 2


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_random_tokenizer_data())


# ---- Tokenizer ----------------------------------------------------------------------------------------------------

def test_tiny_tokenizer_is_one_token_per_byte(tiny):
    text = "héllo 😀"
    ids = tiny.encode(text)
    assert len(ids) == len(text.encode("utf-8")) == 11
    assert tiny.decode(ids) == text
    assert tiny.vocab_size == 259 and tiny.bos_token_id == IM_START and tiny.eos_token_ids == [IM_END]


def test_control_tokens_are_whole_and_skippable(tiny):
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END and len(ids) == 2 + len("user\nhi")
    assert tiny.decode(ids) == "user\nhi"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tiny.id_to_token(IM_END) == "<|im_end|>"


def test_chat_template_renders_chatml(tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def _tokenizer_with_template(template: str) -> Tokenizer:
    data = tiny_random_tokenizer_data()
    data.chat_template = template
    return Tokenizer.from_gguf(data)


def test_chat_template_helpers_and_sandbox():
    raising = _tokenizer_with_template("{{ raise_exception('only user turns, got ' + messages[0]['role']) }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns, got system"):
        raising.apply_chat_template([{"role": "system", "content": ""}])
    specials = _tokenizer_with_template("{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}")
    assert specials.apply_chat_template([], tools=[{"name": "é"}]) == '<|im_start|>|<|im_end|>|[{"name": "é"}]'
    escaping = _tokenizer_with_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escaping.apply_chat_template([])


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        _tokenizer_with_template(None).apply_chat_template([{"role": "user", "content": "hi"}])


def _write_hf_tokenizer(directory, add_bos_token: bool, post_processor_bos: bool) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<eot>"] + alphabet)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<eot>"])
    if post_processor_bos:  # as Llama's tokenizer.json does
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": add_bos_token,
              "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


@pytest.mark.parametrize("post_processor_bos", [False, True])
def test_hf_directory_tokenizer(tmp_path, post_processor_bos):
    _write_hf_tokenizer(tmp_path, add_bos_token=True, post_processor_bos=post_processor_bos)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_ids == [1, 2]
    ids = tokenizer.encode("hi")
    assert ids[0] == 0 and len(ids) == 3  # BOS once, whoever adds it
    assert tokenizer.encode("hi", add_special_tokens=False) == ids[1:]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_hf_directory_prefers_chat_template_jinja(tmp_path):
    _write_hf_tokenizer(tmp_path, add_bos_token=False, post_processor_bos=False)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} messages")
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}] * 2) == "2 messages"


def test_load_tokenizer_by_name(tmp_path, tiny):
    # Byte tokens follow the 3 specials in code-point order of GPT-2's byte spelling: "h" (0x68) is the 72nd
    # printable ("!" first), é's bytes C3 A9 are spelled "Ã" and "©".
    ids = load_tokenizer("tiny-random").encode("<|im_start|>hé")
    assert ids == tiny.encode("<|im_start|>hé") == [1, 74, 130, 105]
    _write_hf_tokenizer(tmp_path, add_bos_token=True, post_processor_bos=False)
    assert load_tokenizer(str(tmp_path)).encode("hi") == Tokenizer.from_hf_dir(tmp_path).encode("hi")


def test_unsupported_gguf_vocabularies_are_rejected():
    data = tiny_random_tokenizer_data()
    data.pre = "deepseek-llm"
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'deepseek-llm'"):
        Tokenizer.from_gguf(data)
    data.model = "llama"
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'llama'"):
        Tokenizer.from_gguf(data)


# ---- SmolLM2's real vocabulary ----------------------------------------------------------------------------------

SAMPLES = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "The year 2024 had 366 days; pi is 3.14159.",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷",
    "Accents: naïve café, Ärger, señor, Zürich. Ελληνικά, русский, 日本語",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nwindows newlines, trailing spaces   ",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(load_gguf(smollm2_gguf_path())[2])


@pytest.fixture(scope="module")
def transformers_reference():
    """transformers' own GGUF tokenizer conversion, the independent reference."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(smollm2_gguf_path()))
    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


@pytest.mark.model
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_ids_match_transformers(smollm2, transformers_reference, text):
    assert smollm2.encode(text) == transformers_reference.encode(text).ids
    assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


@pytest.mark.model
def test_smollm2_isolates_digits_like_llama_cpp(smollm2):
    """SmolLM2's pre-tokenizer (llama.cpp "smollm": "\\p{N}" before GPT-2's pattern) splits digits off first, so
    the spaces before them stay one run ("ĠĠ"). transformers' GGUF conversion (GPT-2's pattern alone) gives
    "Ġ" "Ġ" "1" here, which is why these strings are not in the comparison above."""
    ids = smollm2.encode("x  12")
    assert [smollm2.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1", "2"]
    assert ids == [104, 256, 33, 34]
    assert [smollm2.id_to_token(i) for i in smollm2.encode("\n    10")] == ["ĊĠĠĠĠ", "1", "0"]


@pytest.mark.model
def test_smollm2_load_tokenizer_reads_no_weights(smollm2):
    tokenizer = load_tokenizer("smollm2-135m")
    assert tokenizer.encode(SAMPLES[4]) == smollm2.encode(SAMPLES[4])
    assert tokenizer.eos_token_ids == [2] and tokenizer.chat_template == smollm2.chat_template


@pytest.mark.model
def test_smollm2_specials_and_chat_template(smollm2):
    assert smollm2.vocab_size == 49152 and smollm2.bos_token_id == 1 and smollm2.eos_token_ids == [2]
    assert smollm2.encode("<|im_start|>user") == [1, 4093]
    assert smollm2.apply_chat_template([{"role": "user", "content": "Hi!"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
