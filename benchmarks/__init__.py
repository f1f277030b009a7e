"""amppass benchmarks: `python -m benchmarks run --quick|--full [--out DIR]` regenerates RESULTS.md and plots."""
