"""BERT pretraining on DeepSpeed: model, ZeRO-exact LAMB, two-phase driver, SQuAD."""

__version__ = "0.1.0"
