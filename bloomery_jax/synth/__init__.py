"""Synthetic GGUF models for tests: random weights of a real architecture plus a real tokenizer."""
