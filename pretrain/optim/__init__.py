"""Our LAMB, exact under ZeRO 0-3.

Read in this order: `lamb_math` (the per-tensor math, one function per line of the algorithm),
`lamb` (the torch optimizer `ExactLamb` that DeepSpeed steps), `zero_layout` (how a flat ZeRO
partition maps back to whole parameters, so that trust ratios stay per layer), `fused_lamb` (the
compiled multi-tensor step used on CUDA), `lamb_reference` (the plain textbook version every test
and benchmark compares against). Nothing here imports DeepSpeed except through the engine that
hands a partition over (pretrain/engine.py).
"""
