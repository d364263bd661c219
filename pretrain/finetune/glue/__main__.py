"""``python -m pretrain.finetune.glue {evaluate,finetune} ...`` (declared in pretrain/finetune/commands.py)."""

from pretrain.finetune.commands import GLUE

main = GLUE.main

if __name__ == "__main__":
    GLUE.exit()
