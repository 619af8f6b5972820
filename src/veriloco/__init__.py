"""veriloco: verifiable, low-communication decentralized training (DiLoCo / DiLoCoX).

Start reading at `round.py`: one outer round, top to bottom.
"""

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that `import veriloco.cli` does not import torch: `veriloco
# train` starts the workers' forkserver before its own imports (cli.train).
_EXPORTS = {"Config": "config", "load_config": "config", "train": "run", "train_task": "run", "Task": "task",
            "resume_task": "run", "join_task": "run", "torchrun_task": "run", "audit_run": "audit",
            "audit_task": "audit"}
__all__ = ["Config", "Task", "audit_run", "audit_task", "join_task", "load_config", "resume_task", "torchrun_task",
           "train", "train_task", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
