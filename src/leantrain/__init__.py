"""leantrain: memory- and communication-efficient training of Llama-style models."""

__version__ = "0.1.0"
