"""Everything that changes over training, as a function of one measure of how far a phase is (`Progress`).

`progress.py` holds `Progress` (optimizer steps, samples, tokens: the three units a recipe counts in) and the
phase's clock, which says where any step or sample of the stream lies; `masking.py` the masking-rate schedules
(`MASK_SCHEDULES`); the lr schedules are `SCHEDULES` in pretrain/schedules/lr.py, read at `Progress.step` through
DeepSpeed's LambdaLR. `PhaseSchedules` (phase.py) is what the plan hands a phase: the clock and its schedules,
and the values the trainer logs every step (schedule/<name>).
"""
