"""Weight sources: each turns a file or shape name into (ModelConfig, tensors
in Hugging Face names, tokenizer). The model never sees where weights came from."""
