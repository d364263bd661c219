"""The model: transformers' BERT with a sparse MLM head (bert.py), the reference every fast path is tested against."""
