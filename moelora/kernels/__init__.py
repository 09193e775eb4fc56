"""Triton kernels, each beside its torch reference.

Row counts (tokens, (token, expert) pairs, rows, programs derived from them) are passed to the kernels as plain
integers, not specialised by Triton (`do_not_specialize`): they only bound masks and loops, whereas specialised
each would make every kernel tile compile up to three times (at 1, at a multiple of 16, otherwise), the batch
picking which. Those compiles are most of a cold engine start (benchmarks/RESULTS.md)."""
