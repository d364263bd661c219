"""The run's configuration: typed sections (sections), loading and checks (load), the DeepSpeed dict (deepspeed),
the generated docs (doc), the light CLI (cli), the recipe scaler (scale) and the CPU rehearsal (rehearsal)."""
