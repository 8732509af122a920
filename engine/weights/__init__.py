"""Weight sources: each turns a file or shape name into (ModelConfig, tensors
in Hugging Face names, tokenizer). The model never sees where weights came from.
merge.py then joins the per-matrix tensors of projections that share an input
into the model's merged modules (the loader calls it; sources never do)."""
