"""Text <-> token ids: ``tokenizer.py`` (the ``Tokenizer``), ``tokenizer_files.py`` (model names to tokenizers, without
torch), ``detokenizer.py`` (incremental detokenization), ``stop_strings.py`` (stop strings in growing text) and
``byte_tokenizer.py`` (a byte-level tokenizer's files for a checkpoint built in code).
"""
