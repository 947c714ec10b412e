"""Reading a DeepSpeed config from whatever the user hands over: a dict, a path to a ``.json`` file, a JSON
string or base64-encoded JSON (what the ``deepspeed`` launcher passes on the command line).

The public face of two layers: the reading (``_source``) sits below ``config``, whose ``DeepSpeedConfig.load``
uses it, and ``load_config`` sits in ``config`` next to the model it builds.
"""

from ds_config._source import ConfigSourceError, parse_json, read_source
from ds_config.config import load_config

__all__ = ["ConfigSourceError", "load_config", "parse_json", "read_source"]
