"""Running one model over several processes with torch.distributed (NCCL on GPUs, gloo on CPUs): the
parallel layout and its groups (state), collectives that are the identity at one rank (comm), which part
of a dimension a rank holds (sharding), and starting the other ranks on this machine (launch).

Below the kernels in the import order: it imports nothing of moelora, and layers, models and the engine
all use it."""
