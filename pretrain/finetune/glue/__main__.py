"""``python -m pretrain.finetune.glue {evaluate,finetune} ...`` (declared in pretrain/finetune/glue/command.py)."""

from pretrain.finetune.glue.command import GLUE

main = GLUE.main

if __name__ == "__main__":
    GLUE.exit()
