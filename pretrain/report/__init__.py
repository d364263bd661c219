"""The run folder read back: run records (records), the run clock (clock), time to quality (quality), the
report (write, run as `python -m pretrain.report`), its plot (plot) and the export's model card (model_card)."""
