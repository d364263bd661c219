"""The shard format that the build writes and the training ranks read, and everything both sides share: the
format and its manifest (shards.py), atomic writes and checksums (atomic_io.py), the vocab (vocab.py), BERT's
masking rule (masking.py), the modes a manifest records (modes.py), the tokenizer probe (tokenizer_probe.py) and
the keyed hash of both sides' orders (keyed_hash.py).

pretrain/ imports data_prep only through this subpackage (tests/data/test_shard_format_boundary.py), and nothing
here imports the rest of data_prep: a rank never loads the build's readers, cleaners or task graph.
"""
