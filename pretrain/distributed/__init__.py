"""This process's place in the job and its life: its process group (process_group) and the value that describes it
(info), the cluster's environment (cluster: node lists, hostfiles, rendezvous, device index), dying with its
parent and the run folder's lock (lifetime), stop requests from signals (stop_request), the step watch the
elastic agent times (step_watch), and DeepSpeed's JIT op builds (extension_builds).

The launcher's processes (pretrain/launch/) sit above this package and may import it; nothing here imports
them. Importing this package imports nothing: `python -m pretrain.distributed.cluster` runs on a bare python3."""
