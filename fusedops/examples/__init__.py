"""Examples built on fusedops: `python -m fusedops.examples.lm` trains a small AttnRes language model."""
