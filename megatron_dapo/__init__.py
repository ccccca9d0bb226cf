"""megatron-dapo: the DAPO reinforcement-learning recipe on Megatron-Core."""

__version__ = "0.1.0"
