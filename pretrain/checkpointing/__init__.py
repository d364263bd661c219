"""Checkpoints on disk: DeepSpeed's tags and their consolidation (`checkpoint`), how a save commits on every
rank or fails on every rank (`commit`), the manifest that tells an intact tag from a torn one and marks it
committed (`manifest`), the conversion that lets a run resume at another world size (`elastic`), when a step
checkpoint is due (`cadence`, torch-free), how much disk a run's checkpoints and exports take (`disk`,
torch-free), and the Hugging Face export that reads them (`export`).
"""
