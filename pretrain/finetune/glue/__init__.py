"""GLUE fine-tuning of our BERT exports, with GLUE's own metrics and the GLUE server's submission files.

Modules: tasks (each task's files, columns, labels, metrics, as data), data (the TSV, save_to_disk and
parquet readers, no torch), metric (Matthews, Pearson/Spearman, F1, accuracy; standard library only),
submission (prediction files), evaluate (the scoring command), finetune_args (the flags), finetune
(DeepSpeed, N seeds). docs/glue.md is the user's guide.
"""
