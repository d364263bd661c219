"""``python -m pretrain.finetune.squad {evaluate,finetune} ...`` (declared in pretrain/finetune/commands.py)."""

from pretrain.finetune.commands import SQUAD

main = SQUAD.main

if __name__ == "__main__":
    SQUAD.exit()
