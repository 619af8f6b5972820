"""veriloco: verifiable, low-communication decentralized training (DiLoCo / DiLoCoX).

Start reading at `round.py`: one outer round, top to bottom.
"""

__version__ = "0.1.0"

from .config import Config, load_config  # noqa: E402
from .run import train, train_task  # noqa: E402
from .task import Task  # noqa: E402

__all__ = ["Config", "Task", "load_config", "train", "train_task", "__version__"]
