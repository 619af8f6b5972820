"""veriloco: verifiable, low-communication decentralized training (DiLoCo / DiLoCoX).

Start reading at `round.py`: one outer round, top to bottom.
"""

__version__ = "0.1.0"
