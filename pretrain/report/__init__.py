"""The run folder read back: run records (records), the report (write, run as `python -m pretrain.report`),
its plot (plot) and the export's model card (model_card). What training writes is pretrain/metrics/."""
