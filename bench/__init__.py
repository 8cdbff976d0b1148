"""`python -m bench` in a checkout: an alias of `python -m fusedops.bench` (the benchmark ships in the package,
fusedops/bench/). This folder holds what is not package code: NOTES.md (every measurement), results/ (the
runs' JSON and plots), gpu_check.sh, and experiments/ (one-off scripts, imported by nothing)."""
