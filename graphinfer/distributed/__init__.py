"""Tensor parallelism over torch.distributed: process groups (parallel_state), collectives as graphinfer:: ops
(communication_op), and the processes of the other ranks (launch). Below runtime/, above ops/."""
