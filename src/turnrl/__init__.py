"""turnrl: reinforcement learning of language models on multi-turn tasks, with turn-level credit."""

__version__ = "0.1.0"
