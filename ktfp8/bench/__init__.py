"""ktfp8's benchmark suite: ktfp8's backends side by side with the peers a user would pick instead
(kt-kernel, PyTorch, NumPy), on the same weights and routing, against this machine's measured limits
(read bandwidth and the peak of each compute unit: the roofline).

This package (`ktfp8/bench/`, shipped with ktfp8) is the command line: `python -m ktfp8.bench
[--quick]`; the repository's top-level `bench/` folder holds pytest-benchmark cases (`pytest bench
--benchmark-only`) that drive the same sides through this package and are not installed."""
