"""`pagecli bench`: the analytic memory model, built-in workloads, the measured run and the transformers comparison."""
