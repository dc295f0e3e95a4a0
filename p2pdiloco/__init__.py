"""p2pdiloco: peer-to-peer Decoupled DiLoCo over a hivemind DHT.

Kept import-free so that `p2pdiloco --help` never pays for torch or hivemind.
"""

__version__ = "0.1.0"
