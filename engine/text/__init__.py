"""Text <-> token ids: ``tokenizer.py`` (the ``Tokenizer``), ``tokenizer_files.py`` (model names to tokenizers, without
torch), ``detokenizer.py`` (incremental detokenization) and ``stop_strings.py`` (stop strings in growing text).
"""
