"""Text <-> token ids: the tokenizer, its files, incremental detokenization and stop strings."""
