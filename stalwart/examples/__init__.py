"""Example training programs, runnable in the trainer image as ``python -m stalwart.examples.<name>``."""
