"""buildtrain: a build system for neural-network training.

Presets compile into content-hashed plans (config -> plan -> store -> executor -> steps -> verify);
identical plan hashes reproduce identical weights, bit for bit.
"""

__version__ = "0.1.0"
