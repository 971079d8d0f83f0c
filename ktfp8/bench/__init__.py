"""ktfp8's benchmark suite: ktfp8's backends side by side with the peers a user would pick instead
(kt-kernel, PyTorch, NumPy), on the same weights and routing, against this machine's measured limits.

Run `python -m ktfp8.bench [--quick]`; `pytest bench --benchmark-only` drives the same sides."""
