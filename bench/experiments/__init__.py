"""Experiment-only scripts (`python -m bench.experiments.<name>` from the repository root): each measured one
question once; its results are in bench/NOTES.md. Not package code: nothing imports them."""
