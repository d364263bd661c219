"""Data preparation: raw corpora -> WordPiece ids -> BERT pretraining shards."""

__version__ = "0.1.0"
