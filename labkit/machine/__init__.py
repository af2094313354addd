"""The machine the helpers run on: launching ranks (`launcher`, `torchrun`, `worker`, `rank_setup`), what a
rank asks of its device (`runtime`, `timer`, `device_memory`), what stands in for GPUs (`emulate`: the
emulated and simulated clusters, CI's fake CUDA), NCCL's flight recorder, the `Machine` value a lab resolves
once (`machine`), and every private torch internal labkit touches (`_torch_compat`)."""
