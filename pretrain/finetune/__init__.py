"""Fine-tuning our exports: what SQuAD and GLUE share (common), and the two tasks, siblings that
never import each other (squad/, glue/)."""
