"""Training: configs, data (byte tokenizer, Shakespeare, MQAR, NIAH, packing), trainer, checkpoints, metrics, CLI.

Heavy modules (the trainer, orbax) load on first use: `from lineattn.train.trainer import train`.
"""

from lineattn.train.config import Config, ConfigError, load_config
from lineattn.train.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Config", "ConfigError", "load_config"]
