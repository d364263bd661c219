"""What is written while training: the metrics writer with throughput, FLOPs and MFU (writer), the run clock
across resumes (clock) and the quality marks reached (quality). pretrain/report/ reads them back."""
