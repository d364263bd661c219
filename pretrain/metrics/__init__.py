"""What is written while training: the metrics writer with throughput, FLOPs and MFU (writer), the run clock
across resumes (clock) and where its time went (goodput), the quality marks reached (quality), and the step
monitors: what a step logs beyond its losses and rates, one class per file (monitor: the contract; monitors:
their table, which the plan hands the trainer). pretrain/report/ reads them back."""
