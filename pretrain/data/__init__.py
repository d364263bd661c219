"""Shards -> micro-batches: the rank's batches and collator (batches), the unpadded batch format (unpadded),
the DataLoader (loader), packing (packing) and the shard-folder checks (shard_checks)."""
