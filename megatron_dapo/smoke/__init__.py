"""`megatron-dapo smoke`: one command that checks the GPU paths end to end (plan.py: the steps and
their sizes for this machine; run.py: running them and the table; push.py: the weight push against
a device copy)."""
