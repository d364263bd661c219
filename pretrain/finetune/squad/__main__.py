"""``python -m pretrain.finetune.squad {evaluate,finetune} ...`` (declared in pretrain/finetune/squad/command.py)."""

from pretrain.finetune.squad.command import SQUAD

main = SQUAD.main

if __name__ == "__main__":
    SQUAD.exit()
