"""Checkpoints on disk: DeepSpeed's tags and their consolidation (`checkpoint`), the manifest
that tells an intact tag from a torn one (`manifest`), the conversion that lets a run resume
at another world size (`elastic`), and when a step checkpoint is due (`cadence`, torch-free).
The Hugging Face export that reads them is pretrain/checkpointing/export.py.
"""
