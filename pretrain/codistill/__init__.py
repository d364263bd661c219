"""Codistillation (Anil et al. 2018): two models trained by two engine groups teach each other.

An optional feature: it plugs into the plain driver from outside (pretrain/train.py chooses it
when the run config enables it) and the core driver, trainer and config never import this
package. `plugin` is the entry point; `config` its settings, `groups` its process groups,
`exchange` how teacher weights travel between groups, `teacher` the frozen teacher copy.
"""
