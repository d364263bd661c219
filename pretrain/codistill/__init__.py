"""Codistillation (Anil et al. 2018): two models trained by two engine groups teach each other.

An optional feature: a plug-in of the plain driver through the hooks of pretrain/plugin.py, found by
the entry point `bert_ds.plugins: codistill` when a RUN.json has a `codistill` section; the core
driver, trainer and config never import this package. `spec` is what it registers (section, checks,
factory); `plugin` the hooks; `config` its settings, `groups` its process groups, `exchange` how
teacher weights travel between groups, `teacher` the frozen teacher copy.
"""
