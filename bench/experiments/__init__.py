"""Experiment-only scripts: each measured one question once; its results are in bench/NOTES.md."""
