"""SQuAD fine-tuning of our BERT exports and a scorer equal to the official SQuAD v1.1 / v2.0 scripts.

Modules: metric (EM/F1, no torch), data (loading and validation), features (tokenised windows),
postprocess (logits → answers, numpy only), evaluate (the scoring command), finetune (DeepSpeed).
"""
